"""A null target: an in-process Generation server that answers at once.

Every request gets max_tokens one-token chunks and a final event, with no
model and no waiting, so a run against it measures only the client (and gRPC).
One chunk per token is the most per-token work a client can be asked to do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

DEFAULT_MAX_TOKENS = 16  # the daemon's default, mirrored


class NullGeneration(pb_grpc.GenerationServicer):
    async def Generate(  # noqa: N802 (the gRPC method name)
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateEvent]:
        sampling = request.sampling
        count = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        for position in range(1, count + 1):
            reason = "length" if position == count else ""
            chunk = pb.Chunk(token_ids=[position % 7], num_tokens=position, finish_reason=reason)
            yield pb.GenerateEvent(chunk=chunk)
        usage = pb.Usage(prompt_tokens=len(request.token_ids), completion_tokens=count)
        yield pb.GenerateEvent(final=pb.Final(usage=usage, finish_reason="length"))


async def start_null_server() -> tuple[grpc.aio.Server, str]:
    """Start it on 127.0.0.1 at a free port; returns the server and its address."""
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(NullGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
