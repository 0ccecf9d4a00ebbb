"""The daemon's gRPC servicer on a real server on 127.0.0.1, in the test's own
process, over an engine the test built: for tests that hold or break a step."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from specpage.config import Config
from specpage.engine import Engine
from specpage.engine.async_engine import AsyncEngine
from specpage.serve.daemon import server_info
from specpage.serve.frontend import Frontend
from specpage.serve.grpc_server import GenerationService
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

MAX_PROMPT_TOKENS = 100


@dataclass
class Served:
    engine: Engine
    async_engine: AsyncEngine
    service: GenerationService
    address: str


@contextlib.asynccontextmanager
async def serving_engine(engine: Engine, max_queue: int = 8) -> AsyncIterator[Served]:
    async_engine = AsyncEngine(engine, max_queue, max_prompt_tokens=MAX_PROMPT_TOKENS)
    service = GenerationService(lambda e: server_info(Config(), e), Frontend())
    service.attach(async_engine)
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async_engine.start()
    try:
        yield Served(engine, async_engine, service, f"127.0.0.1:{port}")
    finally:
        await async_engine.stop()
        await server.stop(None)
