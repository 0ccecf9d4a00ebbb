"""The daemon's lifecycle: load the models, serve gRPC, drain on SIGTERM.

Health is NOT_SERVING until the models are loaded and again while draining.
systemd hears STATUS= lines while loading, READY=1 once the port is bound,
WATCHDOG=1 from the event loop, and STOPPING=1 when the drain starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specpage import systemd
from specpage.async_engine import AsyncEngine
from specpage.config import Config, read_bearer_token
from specpage.engine import Engine, EngineConfig, EngineStats, RequestOutput
from specpage.llm import load_tokenizer, resolve_model
from specpage.metrics import Metrics
from specpage.models.loader import load_model
from specpage.server import BearerTokenInterceptor, GenerationService, wait_idle
from specpage.v1 import generation_pb2 as pb
from specpage.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("specpage.daemon")
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VERSION = "0.1.0"


def build_engine(config: Config) -> Engine:
    """Load both models (slow: minutes for big ones) and build the engine."""
    m, e = config.model, config.engine
    systemd.status(f"loading target {m.target}")
    target = load_model(resolve_model(m.target), m.dtype, m.device)
    draft = None
    if m.draft:
        systemd.status(f"loading draft {m.draft}")
        draft = load_model(resolve_model(m.draft), m.dtype, m.device)
    engine_config = EngineConfig(
        block_size=e.block_size, num_blocks=e.num_blocks, max_num_seqs=e.max_num_seqs,
        max_step_tokens=e.max_step_tokens, max_context=e.max_context, spec_k=e.spec_k,
        adaptive_k=e.adaptive_k, stop_limits=e.stop_limits,
    )
    return Engine(target, draft, load_tokenizer(target.folder), engine_config)


def server_info(config: Config, engine: AsyncEngine) -> pb.ServerInfo:
    stats = engine.stats()
    inner = engine.engine
    return pb.ServerInfo(
        version=VERSION,
        target_model=config.model.target,
        draft_model=config.model.draft or "",
        block_size=inner.config.block_size,
        max_context=inner.max_context,
        pool=pb.PoolCounters(total=stats.total_blocks, free=stats.free_blocks,
                             cached=stats.cached_blocks, in_use=stats.in_use_blocks,
                             tentative=stats.tentative_blocks),
        current_k=stats.current_k, acceptance=stats.acceptance,
        drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
        running=stats.running, waiting=stats.waiting, preemptions=stats.preemptions,
        prefix_cached_tokens=stats.prefix_cached_tokens,
    )


class MetricsObserver:
    """Feeds each step's outputs and stats into the Prometheus metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.positions: tuple[int, ...] = ()
        self.last_token: dict[tuple[str, int], float] = {}

    def __call__(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        now = time.monotonic()
        for out in outputs:
            key = (out.request_id, out.index)
            if out.token_ids and key in self.last_token:
                self.metrics.observe_itl((now - self.last_token[key]) / len(out.token_ids))
            self.last_token[key] = now
            if out.finished:
                self.metrics.observe_finish(out.finish_reason or "unknown")
                self.last_token.pop(key, None)
        previous = self.positions or (0,) * len(stats.accepted_by_position)
        self.metrics.observe_accepted_positions(
            [now_count - before for now_count, before in zip(
                stats.accepted_by_position, previous, strict=True)])
        self.positions = stats.accepted_by_position
        self.metrics.update_engine(stats)


async def serve(config: Config) -> int:
    s = config.server
    systemd.status("starting")
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    token = read_bearer_token(s)
    server = grpc.aio.server(
        interceptors=[BearerTokenInterceptor(token)] if token else [],
        options=[("grpc.max_receive_message_length", s.max_message_bytes),
                 ("grpc.max_send_message_length", s.max_message_bytes)],
    )
    metrics = Metrics()
    service = GenerationService(lambda engine: server_info(config, engine), s.max_prompt_tokens,
                                on_first_token=metrics.observe_ttft)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    address = f"{s.host}:{s.port}"
    if s.tls_cert and s.tls_key:
        credentials = grpc.ssl_server_credentials(
            [(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    await server.start()  # health answers NOT_SERVING while the models load
    log.info("listening", extra={"address": f"{s.host}:{port}"})

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    engine = AsyncEngine(await asyncio.to_thread(build_engine, config), s.max_queue)
    metrics_server = None
    engine.step_observers.append(MetricsObserver(metrics))
    if s.metrics_port is not None:
        metrics_server = metrics.start_http(s.metrics_host, s.metrics_port)
    service.attach(engine)
    engine.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    systemd.status(f"serving on {s.host}:{port}")
    systemd.ready()
    # Pings start once ready: TimeoutStartSec covers the loading.
    watchdog = None
    interval = systemd.watchdog_interval()
    if interval is not None:
        watchdog = loop.create_task(systemd.watchdog_loop(interval), name="watchdog")
    log.info("ready", extra={"address": f"{s.host}:{port}", "target": config.model.target,
                             "draft": config.model.draft})
    try:
        await stop.wait()
    finally:
        systemd.stopping()
        log.info("draining", extra={"grace_s": s.drain_grace_s, "in_flight": service.in_flight})
        engine.draining = True
        await health_servicer.enter_graceful_shutdown()
        await wait_idle(service, s.drain_grace_s)
        await engine.stop()  # aborts what is left
        await server.stop(grace=1.0)
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        if metrics_server is not None:
            metrics_server.close()
        log.info("stopped")
    return 0
