"""What every backend shares: the target, the per-request options, and the interface
the runner drives.

Two backends speak to a target: gRPC `Generate` (loadgen/client.py) and the
OpenAI-compatible HTTP API (loadgen/openai_client.py), so one workload, one
arrival schedule and one set of SLOs can be run against specpage over either
front, or against another OpenAI-compatible server.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from loadgen.prompts import Conversation
from loadgen.record import RequestRecord
from loadgen.workload import RequestSpec

# 64 random bits: two runs never land in one prefix-cache namespace by chance.
CACHE_SALT_BYTES = 8


class TargetError(RuntimeError):
    """The target cannot be reached or is not serving."""


@dataclass(frozen=True)
class TargetOptions:
    address: str = "127.0.0.1:50051"  # HOST:PORT for grpc, a base URL for openai
    tls: bool = False
    tls_ca_pem: bytes | None = field(default=None, repr=False)  # None with tls: system roots
    token: str | None = field(default=None, repr=False)
    request_timeout_s: float = 300.0
    api: str = "grpc"  # grpc | openai
    model: str | None = None  # openai: the `model` sent; None asks GET /v1/models


@dataclass(frozen=True)
class RequestOptions:
    temperature: float | None = None  # None: the server's default
    spec: str = "auto"
    chat: bool = False
    ignore_eos: bool = True  # so output lengths are what the workload asked for
    # A seeded request is sampled (and speculated) differently from the unseeded ones
    # clients send, so seeds go out only when asked for.
    request_seeds: bool = False
    # Off: each run gets its own cache_salt, so it starts with a cold prefix cache
    # instead of the blocks an earlier run (or sweep point) left with the same prompts.
    share_prefix_cache: bool = False
    cache_salt: str = ""  # this run's prefix-cache namespace; "" is the shared one

    def for_new_run(self) -> RequestOptions:
        """These options with the next run's cache namespace: a fresh one unless shared."""
        if self.share_prefix_cache:
            return dataclasses.replace(self, cache_salt="")
        salt = f"loadgen-{secrets.token_hex(CACHE_SALT_BYTES)}"
        return dataclasses.replace(self, cache_salt=salt)

    def policy(self) -> dict[str, Any]:
        """The choices that shape what the server does with each request, for the report."""
        return {
            "prefix_cache": "shared" if self.share_prefix_cache else "fresh per run",
            "cache_salt": self.cache_salt,
            "request_seeds": self.request_seeds,
        }


class Backend(Protocol):
    """One target's client. `options` is replaced between runs (each run has its own
    cache namespace), never while one is in flight."""

    target: TargetOptions
    options: RequestOptions

    async def connect(self, health_timeout_s: float) -> None:
        """Wait until the target serves (0: do not wait) and learn what requests need."""

    def describe(self) -> dict[str, Any]:
        """The API, address and what the requests went to, for the report."""

    def new_record(self, spec: RequestSpec) -> RequestRecord: ...

    async def generate(
        self, spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]
    ) -> None:
        """Send one request and record its stream; returns when the stream has ended."""

    async def close(self) -> None: ...


def new_record(spec: RequestSpec, run_tag: str) -> RequestRecord:
    """A request's empty record; run_tag keeps ids unique across concurrent loadgen runs."""
    prompt = spec.prompt
    if isinstance(prompt, Conversation):
        prompt_len = prompt.words()
    else:
        prompt_len = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
    return RequestRecord(
        index=spec.index, warmup=spec.warmup, request_id=f"lg-{run_tag}-{spec.index}",
        prompt_len=prompt_len, max_tokens=spec.max_tokens, prefix_id=spec.prefix_id,
        cancel_after_s=spec.cancel_after_s, item=spec.item, kind=spec.kind,
    )
