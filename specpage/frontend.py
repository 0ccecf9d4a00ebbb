"""What every front end (gRPC, OpenAI-compatible HTTP) does to a request between
its wire format and the engine: size and tokenize the prompt off the event
loop, validate it, admit it, and count it in flight until its stream ends.

A front end turns its message into a `Submission` and maps the errors:
`ValidationError` (naming the field, in the front end's words), `LoadingError`,
`DrainingError` and `QueueFullError` (with `retry_after_ms`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from jinja2 import TemplateError

from specpage.engine.async_engine import AsyncEngine, Chunk, DrainingError, Final, RequestStream
from specpage.request import Request, SamplingParams, ValidationError

# Request ids are echoed as gRPC metadata and HTTP headers, whose values must be
# printable ASCII; 128 characters hold a UUID or a W3C trace id with room to spare.
MAX_REQUEST_ID_LENGTH = 128
# A text prompt of more bytes than max_prompt_tokens x this cannot fit and is
# refused before it is tokenized. SmolLM2's longest token is 81 bytes; common
# byte-level BPE vocabularies stay under 128 too, so no prompt that fits is refused.
PROMPT_BYTES_PER_TOKEN = 128
# Requests tokenized at once, off the event loop, by threads of their own. Fast
# tokenizers release the GIL while they encode, so each one takes a core from
# the engine's step thread. A pool this size bounds them however calls end: a
# cancelled call cannot stop the thread tokenizing its prompt, only free its
# place in a queue, so a semaphore around shared threads would let a client that
# cancels at once keep any number of them busy. Both front ends share it.
PREPARE_CONCURRENCY = 2
# The salt goes into the hash of every prefix-cache block key, on the engine's
# step thread: a tenant id is short, and a long salt would slow every stream.
MAX_CACHE_SALT_BYTES = 256


class LoadingError(Exception):
    """The models are still loading; nothing is admitted yet."""


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise ValidationError("request_id", f"{len(request_id)} characters exceed the limit "
                              f"of {MAX_REQUEST_ID_LENGTH}")
    bad = next((c for c in request_id if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValidationError("request_id", f"character U+{ord(bad):04X} is not printable "
                              "ASCII (0x20-0x7E)")


@dataclass(frozen=True)
class TextPrompt:
    """Text, tokenized as it is, or with chat=True as one user message in the
    model's chat template."""

    text: str
    field: str  # the front end's name for it, in errors
    chat: bool = False
    chat_field: str = "chat"


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: Sequence[int]
    field: str


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation (role and content per message) through the chat template,
    with the assistant's turn opened for the model to write."""

    messages: Sequence[Mapping[str, Any]]
    field: str


Prompt = TextPrompt | TokenPrompt | ChatPrompt


@dataclass(frozen=True)
class Submission:
    """One request as a front end received it, before any per-token work."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival: float  # time.monotonic() when the call came in
    priority: int = 0
    deadline: float | None = None  # time.monotonic() after which it ends "timeout"
    cache_salt: str = ""
    spec_k: int | None = None  # the largest k allowed; None leaves k to the policy
    # None: as many tokens as the context leaves after the prompt (OpenAI's chat default)
    max_tokens_to_context: bool = False


class Frontend:
    """Shared by the front ends of one daemon: one prepare pool, one in-flight count."""

    def __init__(self, max_prompt_tokens: int,
                 on_first_token: Callable[[float], None] = lambda s: None) -> None:
        self._engine: AsyncEngine | None = None
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_tokens * PROMPT_BYTES_PER_TOKEN
        self.on_first_token = on_first_token
        self.in_flight = 0
        self._preparing = ThreadPoolExecutor(PREPARE_CONCURRENCY,
                                             thread_name_prefix="specpage-prepare")

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def close(self) -> None:
        """Drop the prompts still queued for tokenizing (their calls have ended)."""
        self._preparing.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise LoadingError("the models are loading")
        return self._engine

    def check_open(self) -> None:
        """LoadingError or DrainingError unless requests are admitted now."""
        if self.engine.draining:
            raise DrainingError("the server is draining")

    async def admit(self, submission: Submission) -> RequestStream:
        """Prepare the request off the event loop and submit it."""
        self.check_open()
        # Tokenizing and templating take seconds for megabytes of text: the
        # event loop must keep answering health checks and streams meanwhile.
        # A call cancelled while its prompt waits for a thread drops it from
        # the queue; one already tokenizing runs to its end on its thread.
        made = await asyncio.get_running_loop().run_in_executor(
            self._preparing, self._make_request, submission)
        return self.engine.submit(made)

    @contextlib.asynccontextmanager
    async def running(self, stream: RequestStream) -> AsyncIterator[None]:
        """Counts the call in flight (the drain waits for it); however the call
        ends, a request it leaves unfinished is aborted and its blocks freed at
        the engine's next step."""
        self.in_flight += 1
        try:
            yield
        finally:
            # Only this call's own stream: the id may already be reused.
            if self.engine.streams.get(stream.request_id) is stream:
                self.engine.abort(stream.request_id)
            self.in_flight -= 1

    async def events(self, stream: RequestStream,
                     arrival: float) -> AsyncIterator[Chunk | Final]:
        """The stream's events; the first chunk with tokens times the first
        token, for every front end alike."""
        first = True
        async for event in stream.events():
            if first and isinstance(event, Chunk) and event.token_ids:
                self.on_first_token(time.monotonic() - arrival)
                first = False
            yield event

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no call is in flight, at most grace seconds."""
        end = time.monotonic() + grace
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def _make_request(self, submission: Submission) -> Request:
        """All the work that grows with the request; runs off the event loop."""
        salt = submission.cache_salt.encode()
        if len(salt) > MAX_CACHE_SALT_BYTES:
            raise ValidationError("cache_salt", f"{len(salt)} bytes exceed the limit of "
                                  f"{MAX_CACHE_SALT_BYTES}")
        prompt, field = self._prompt(submission.prompt), submission.prompt.field
        params = submission.params
        if submission.max_tokens_to_context and not isinstance(prompt, str):
            room = self.engine.max_context - len(prompt)
            params = msgspec.structs.replace(params, max_tokens=max(1, room))
        made = self.engine.make_request(
            submission.request_id, prompt, params, submission.priority, submission.deadline,
            prompt_field=field, arrival=submission.arrival)
        if len(made.prompt_token_ids) > self.max_prompt_tokens:
            raise ValidationError(field, f"{len(made.prompt_token_ids)} tokens exceed "
                                  f"the limit of {self.max_prompt_tokens}")
        made.cache_salt = salt
        made.spec_k = submission.spec_k
        return made

    def _prompt(self, prompt: Prompt) -> str | list[int]:
        """The prompt, refused by its size before any per-token work."""
        if isinstance(prompt, TokenPrompt):
            if len(prompt.token_ids) > self.max_prompt_tokens:
                raise ValidationError(prompt.field, f"{len(prompt.token_ids)} tokens exceed "
                                      f"the limit of {self.max_prompt_tokens}")
            return list(prompt.token_ids)
        if isinstance(prompt, ChatPrompt):
            size = sum(len(str(m.get("content", "")).encode()) for m in prompt.messages)
            self._check_bytes(size, prompt.field)
            return self._chat_template(prompt.messages, prompt.field)
        self._check_bytes(len(prompt.text.encode()), prompt.field)
        if prompt.chat:
            return self._chat_template([{"role": "user", "content": prompt.text}],
                                       prompt.chat_field)
        return prompt.text

    def _check_bytes(self, size: int, field: str) -> None:
        if size > self.max_prompt_bytes:
            raise ValidationError(field, f"{size} bytes exceed the limit of "
                                  f"{self.max_prompt_bytes} ({self.max_prompt_tokens} tokens)")

    def _chat_template(self, messages: Sequence[Mapping[str, Any]], field: str) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValidationError(field, "the model has no chat template")
        try:
            encoded = tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, return_dict=True)
        except TemplateError as error:  # e.g. a template that wants roles to alternate
            raise ValidationError(field, f"the chat template refused it: {error}") from None
        return list(encoded["input_ids"])


# The finish reasons that mean a request was cut rather than completed, the
# worst first: a fault beats a deadline. An abort is what its caller asked for.
CUT_SHORT_REASONS = ("error", "timeout")


def cut_short(finish_reasons: Sequence[str]) -> str | None:
    """The worst reason a sample was cut short for, or None if all completed."""
    return next((r for r in CUT_SHORT_REASONS if r in finish_reasons), None)
