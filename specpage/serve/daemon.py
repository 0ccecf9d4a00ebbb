"""The daemon's lifecycle: bind the ports, load the models, serve gRPC, drain on SIGTERM.

Every port is bound before the models load, so a taken port fails in seconds.
A start-up failure (port, TLS file, model path or name, incompatible draft)
ends the process with exit status 1 and one JSON log line at level error whose
``error`` says what to fix: every line the daemon writes to stderr is JSON, so
log shippers parse that one like the others, and no traceback follows it. Any
other exception while starting is a bug: it too ends the process with status
1, and its line keeps the traceback.

A tensor-parallel rank that dies (engine.tensor_parallel_size > 1) fails the
requests in flight, and the daemon drains as on SIGTERM and exits with
status 2.

Health is NOT_SERVING until the models are loaded and again while draining.
systemd hears STATUS= lines while loading, READY=1 once the models are loaded,
WATCHDOG=1 from the event loop, and STOPPING=1 when the drain starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specpage import __version__
from specpage.config import Config, ConfigError, read_bearer_token
from specpage.engine import Engine, EngineStats, RequestOutput, builder
from specpage.engine.async_engine import AsyncEngine, step_thread
from specpage.engine.builder import ModelChoice
from specpage.models.config import ModelLoadError
from specpage.serve import systemd
from specpage.serve.allocator import bound_onednn_cache, fix_mmap_threshold
from specpage.serve.frontend import Frontend
from specpage.serve.grpc_server import BearerTokenInterceptor, GenerationService
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc
from specpage.serve.metrics import Metrics, MetricsServer
from specpage.serve.openai_api.listener import HTTPListener, start_http
from specpage.serve.reflection import enable_reflection
from specpage.serve.startup import StartupError, check_port_free, tls_credentials

log = logging.getLogger("specpage.serve.daemon")
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VERSION = __version__
EXIT_STARTUP_FAILED = 1
EXIT_ENGINE_FAILED = 2  # the engine could not go on (a tensor-parallel rank died)
# What a start-up failure may raise that its message explains; anything else is a bug
# and keeps its traceback.
STARTUP_ERRORS = (StartupError, ModelLoadError, ConfigError)


def build_engine(config: Config) -> Engine:
    """Load both models (slow: minutes for big ones) and build the engine."""
    m = config.model

    def loading(role: str, name: str | Path) -> None:
        systemd.status(f"loading {role} {name}")
        log.info(f"loading {role}", extra={"model": str(name)})

    choice = ModelChoice(m.target, m.draft or None, m.dtype, m.device, m.quantization)
    return builder.build_engine(choice, config.engine, loading)[0]


def server_info(config: Config, engine: AsyncEngine) -> pb.ServerInfo:
    stats = engine.stats()
    return pb.ServerInfo(
        version=VERSION,
        target_model=config.model.target,
        draft_model=config.model.draft or "",
        block_size=engine.block_size,
        max_context=engine.max_context,
        pool=pb.PoolCounters(total=stats.total_blocks, free=stats.free_blocks,
                             cached=stats.cached_blocks, in_use=stats.in_use_blocks,
                             tentative=stats.tentative_blocks),
        current_k=stats.current_k, acceptance=stats.acceptance,
        drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
        running=stats.running, waiting=stats.waiting, preemptions=stats.preemptions,
        prefix_cached_tokens=stats.prefix_cached_tokens,
        by_method=[pb.MethodCounts(method=method, drafted_tokens=c.drafted,
                                   accepted_tokens=c.accepted,
                                   accepted_by_position=c.accepted_by_position)
                   for method, c in stats.by_method.items()],
        suffix_cache_tokens=stats.suffix_cache_tokens,
    )


class MetricsObserver:
    """Feeds each step's outputs into the Prometheus metrics, and notes its
    stats for them (set when the metrics are scraped)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.last_token: dict[tuple[str, int], float] = {}  # (request, sample) -> when

    def __call__(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        now = time.monotonic()
        for out in outputs:
            self._observe_tokens(out, now)
            if out.finished:
                self.metrics.observe_finish(out.finish_reason or "unknown")
                self.last_token.pop((out.request_id, out.index), None)
            if out.usage is not None and out.timings is not None:  # the request's last output
                t = out.timings
                queue_s = None if t.first_scheduled is None else t.first_scheduled - t.arrival
                self.metrics.observe_request_end(
                    out.usage.prompt_tokens, queue_s, (t.finished or now) - t.arrival)
        self.metrics.note_engine(stats)

    def _observe_tokens(self, out: RequestOutput, now: float) -> None:
        """One inter-token latency per token after a sample's first.

        A step's tokens arrive together: after an earlier token, the gap since
        it is spread evenly over them; with the sample's first token (TTFT's),
        the others came at the same moment, 0 s after it.
        """
        tokens = len(out.token_ids)
        if not tokens:
            return
        self.metrics.observe_generated(tokens)
        key = (out.request_id, out.index)
        last = self.last_token.get(key)
        if last is None:
            self.metrics.observe_itl(0.0, tokens - 1)
        else:
            self.metrics.observe_itl((now - last) / tokens, tokens)
        self.last_token[key] = now


@dataclass
class Listeners:
    """The bound ports: gRPC (answering NOT_SERVING until attached) and /metrics."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service: GenerationService
    metrics_server: MetricsServer | None
    http: HTTPListener | None  # the OpenAI-compatible API, when server.http_port is set

    @property
    def frontend(self) -> Frontend:
        return self.service.frontend

    async def close(self) -> None:
        await self.server.stop(None)
        if self.http is not None:
            await self.http.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()


async def listen(config: Config, metrics: Metrics) -> Listeners:
    """Bind both ports and start answering, before any model loads."""
    s = config.server
    credentials = tls_credentials(s.tls_cert, s.tls_key) if s.tls_cert and s.tls_key else None
    token = read_bearer_token(s)
    check_port_free("gRPC", s.host, s.port)
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.aio.server(
        interceptors=[BearerTokenInterceptor(token)] if token else [],
        options=[("grpc.max_receive_message_length", s.max_message_bytes),
                 ("grpc.max_send_message_length", s.max_message_bytes),
                 # gRPC's default lets a second daemon bind the same port and take
                 # half the connections; a taken port must be an error instead.
                 ("grpc.so_reuseport", 0)],
    )
    frontend = Frontend(on_first_token=metrics.observe_ttft)
    service = GenerationService(lambda engine: server_info(config, engine), frontend)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                      server)
    metrics_server = None
    try:
        port = bind_grpc(server, s.host, s.port, credentials)
        if s.metrics_port is not None:
            metrics_server = start_metrics(metrics, s.metrics_host, s.metrics_port)
        # /health answers 503 while the models load, as gRPC health does
        http = start_http(config, frontend, metrics if s.metrics_port is not None else None,
                          token)
    except StartupError:
        await server.stop(None)  # give back what was bound, on the loop that owns it
        if metrics_server is not None:
            metrics_server.close()
        raise
    await server.start()  # health answers NOT_SERVING while the models load
    log.info("listening", extra={"address": f"{s.host}:{port}",
                                 "http": None if http is None else f"{s.http_host}:{http.port}"})
    return Listeners(server, port, health_servicer, service, metrics_server, http)


def bind_grpc(server: grpc.aio.Server, host: str, port: int,
              credentials: grpc.ServerCredentials | None) -> int:
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError as error:  # the port taken since check_port_free
        raise StartupError(f"gRPC port {port} on {host}: {error}") from None


def start_metrics(metrics: Metrics, host: str, port: int) -> MetricsServer:
    try:
        return metrics.start_http(host, port)
    except OSError as error:
        raise StartupError(f"metrics port {port} on {host}: {error.strerror}") from None


def startup_failed(error: BaseException) -> int:
    """One error line; a known failure says what to fix, a bug keeps its traceback."""
    known = isinstance(error, STARTUP_ERRORS)
    log.error("start-up failed", extra={"error": str(error)},
              exc_info=None if known else error)
    systemd.status(f"start-up failed: {error}")
    return EXIT_STARTUP_FAILED


async def serve(config: Config) -> int:
    s = config.server
    systemd.status("starting")
    fix_mmap_threshold()  # before the models load (serve/allocator.py)
    bound_onednn_cache()
    metrics = Metrics(model_name=config.model.target)
    try:
        listeners = await listen(config, metrics)
    except Exception as error:  # noqa: BLE001 (every start-up failure ends in one line)
        return startup_failed(error)
    # Everything that runs torch runs on this one thread (see step_thread).
    torch_thread = step_thread()
    loop = asyncio.get_running_loop()
    try:
        built = await loop.run_in_executor(torch_thread, build_engine, config)
    except Exception as error:  # noqa: BLE001
        torch_thread.shutdown(wait=False)
        await listeners.close()
        return startup_failed(error)
    service, port = listeners.service, listeners.port
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    faults: list[str] = []  # a tensor-parallel rank died: drain what is left, exit non-zero

    def on_fault(reason: str) -> None:  # from the engine's watcher thread
        faults.append(reason)
        loop.call_soon_threadsafe(stop.set)

    built.on_fault(on_fault)
    # What start-up made (modules, weights' wrappers, the tokenizer, grpc's
    # objects) lives as long as the daemon: moved out of the cyclic
    # collector's reach, so that its collections, which a step's short-lived
    # objects trigger, stop walking it (each full one walked ~hundreds of
    # thousands of objects, inside a step).
    gc.collect()
    gc.freeze()
    engine = AsyncEngine(built, s.max_queue, s.max_prompt_tokens, torch_thread)
    metrics.update_engine(engine.stats())  # the pool's blocks, all free, before any step
    engine.step_observers.append(MetricsObserver(metrics))
    service.attach(engine)
    engine.start()
    for name in ("", SERVICE):
        await listeners.health.set(name, health_pb2.HealthCheckResponse.SERVING)
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
        frontend = listeners.frontend
        log.info("draining", extra={"grace_s": s.drain_grace_s, "in_flight": frontend.in_flight})
        engine.draining = True
        await listeners.health.enter_graceful_shutdown()
        await frontend.wait_idle(s.drain_grace_s)  # gRPC calls and HTTP requests alike
        await engine.stop()  # aborts what is left, drops the prompts queued for tokenizing
        frontend.close()
        await loop.run_in_executor(torch_thread, built.close)  # stops tensor-parallel ranks
        torch_thread.shutdown(wait=False)
        await listeners.server.stop(grace=1.0)
        if listeners.http is not None:
            await listeners.http.stop()
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        if listeners.metrics_server is not None:
            listeners.metrics_server.close()
        log.info("stopped")
    return EXIT_ENGINE_FAILED if faults else 0
