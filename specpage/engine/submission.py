"""What a front end hands the engine for one request, and the work that turns
it into a `Request`: size the prompt, render a conversation through the chat
template, tokenize, validate, compile a constraint's grammar.

That work grows with the prompt (seconds for megabytes of text), so
`AsyncEngine.add_request` runs it on threads of its own, never on the event
loop and never on the engine's step thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from specpage.core.chat_template import DEFAULT_OPTIONS, TemplateOptions, chat_token_ids
from specpage.core.grammar import Constraint
from specpage.core.request import Request, SamplingParams, ValidationError
from specpage.engine.engine import Engine

# A text prompt of more bytes than max_prompt_tokens x this cannot fit and is
# refused before it is tokenized. SmolLM2's longest token is 81 bytes; common
# byte-level BPE vocabularies stay under 128 too, so no prompt that fits is refused.
PROMPT_BYTES_PER_TOKEN = 128
# The salt goes into the hash of every prefix-cache block key, on the engine's
# step thread: a tenant id is short, and a long salt would slow every stream.
MAX_CACHE_SALT_BYTES = 256


@dataclass(frozen=True)
class TextPrompt:
    """Text, tokenized as it is."""

    text: str


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: Sequence[int]


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation (role and content per message) through the chat template,
    by default with the assistant's turn opened for the model to write."""

    messages: Sequence[Mapping[str, Any]]
    options: TemplateOptions = DEFAULT_OPTIONS


Prompt = TextPrompt | TokenPrompt | ChatPrompt


@dataclass(frozen=True)
class RequestOptions:
    """Everything about one request but its prompt and sampling parameters."""

    request_id: str
    arrival: float  # time.monotonic() when the call came in
    priority: int = 0
    deadline: float | None = None  # time.monotonic() after which it ends "timeout"
    cache_salt: str = ""
    cache_text: bool = True  # False: the request's text stays out of the suffix cache
    spec_k: int | None = None  # the largest k allowed; None leaves k to the policy
    # max_tokens becomes as many tokens as the context leaves after the prompt
    # (OpenAI's chat default)
    max_tokens_to_context: bool = False
    # The front end's names, in errors: the prompt's field, and the field that
    # asked for the chat template (gRPC's `chat` flag; HTTP's `messages` itself).
    prompt_field: str = "prompt"
    chat_field: str = "chat"
    constraint: Constraint | None = None  # what the output must match (core/grammar.py)


class Preparer:
    """Turns a prompt and its options into a Request, refusing what exceeds the
    limits before any per-token work. Touches no engine state: any thread may
    call it."""

    def __init__(self, engine: Engine, max_prompt_tokens: int) -> None:
        self.engine = engine
        self.max_prompt_tokens = max_prompt_tokens

    def make_request(self, prompt: Prompt, params: SamplingParams,
                     options: RequestOptions) -> Request:
        salt = options.cache_salt.encode()
        if len(salt) > MAX_CACHE_SALT_BYTES:
            raise ValidationError("cache_salt", f"{len(salt)} bytes exceed the limit of "
                                  f"{MAX_CACHE_SALT_BYTES}")
        field = options.prompt_field
        prompt_ids = self._prompt(prompt, options)
        if options.max_tokens_to_context and not isinstance(prompt_ids, str):
            room = self.engine.max_context - len(prompt_ids)
            params = msgspec.structs.replace(params, max_tokens=max(1, room))
        made = self.engine.make_request(
            options.request_id, prompt_ids, params, options.priority, options.deadline,
            prompt_field=field, arrival=options.arrival, constraint=options.constraint)
        if len(made.prompt_token_ids) > self.max_prompt_tokens:
            raise ValidationError(field, f"{len(made.prompt_token_ids)} tokens exceed "
                                  f"the limit of {self.max_prompt_tokens}")
        made.cache_salt = salt
        made.cache_text = options.cache_text
        made.spec_k = options.spec_k
        return made

    def _prompt(self, prompt: Prompt, options: RequestOptions) -> str | list[int]:
        """The prompt, refused by its size before any per-token work."""
        field = options.prompt_field
        if isinstance(prompt, TokenPrompt):
            if len(prompt.token_ids) > self.max_prompt_tokens:
                raise ValidationError(field, f"{len(prompt.token_ids)} tokens exceed "
                                      f"the limit of {self.max_prompt_tokens}")
            return list(prompt.token_ids)
        check_bytes(prompt, field, self.max_prompt_tokens)
        if isinstance(prompt, ChatPrompt):
            return chat_token_ids(self.engine.tokenizer, prompt.messages, options.chat_field,
                                  prompt.options)
        return prompt.text


def token_ids(tokenizer: Any, prompt: TextPrompt | ChatPrompt, field: str,
              max_prompt_tokens: int, add_special_tokens: bool = False) -> list[int]:
    """A prompt's token ids as vLLM's /tokenize shows them: text with or without
    the tokenizer's special tokens, a conversation through the chat template
    (its options say how). Refused by its size first, as a request's is;
    runs on the caller's thread, which must not be the event loop's."""
    check_bytes(prompt, field, max_prompt_tokens)
    if isinstance(prompt, ChatPrompt):
        return chat_token_ids(tokenizer, prompt.messages, field, prompt.options)
    if tokenizer is None:
        raise ValidationError(field, "the model has no tokenizer")
    return list(tokenizer.encode(prompt.text, add_special_tokens=add_special_tokens))


def check_bytes(prompt: TextPrompt | ChatPrompt, field: str, max_prompt_tokens: int) -> None:
    """Refuse text that cannot fit max_prompt_tokens, before tokenizing it."""
    if isinstance(prompt, ChatPrompt):
        size = sum(len(str(m.get("content", "")).encode()) for m in prompt.messages)
    else:
        size = len(prompt.text.encode())
    limit = max_prompt_tokens * PROMPT_BYTES_PER_TOKEN
    if size > limit:
        raise ValidationError(field, f"{size} bytes exceed the limit of {limit} "
                              f"({max_prompt_tokens} tokens)")
