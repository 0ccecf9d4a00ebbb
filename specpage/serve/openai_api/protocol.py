"""The request bodies of OpenAI's /v1/chat/completions and /v1/completions.

Every field OpenAI's API reference defines is known, with vLLM's extensions
where the engine has them (`top_k`, `ignore_eos`, `stop_token_ids`,
`cache_salt`, `priority`), so the bodies that common clients send decode. A
field that no API defines, and a known field at a value the engine cannot
honour (a `presence_penalty` other than 0, tools, top log-probabilities...),
is a `ValidationError` naming it: nothing a client asks for is silently
ignored. `neutral` lists what each unsupported field may be.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

import msgspec

from specpage.core.request import SamplingParams, ValidationError


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's padding against side channels; none here
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (not offered here)


class ContentPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str = ""


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Tool calling and audio are not offered; these are accepted only empty.
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None


class SamplingFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Fields the two endpoints share."""

    model: str | None = None  # None or "": the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end user, for its own logs: nothing to honour
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None  # 0 or -1: every token
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    no_suffix_cache: bool = False  # keep the request's text out of the suffix cache
    priority: int = 0  # lower runs first


class ChatCompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True,
                            kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None  # kept with stored completions; none are stored
    prompt_cache_key: str | None = None  # OpenAI's routing hint; the prefix cache needs none
    safety_identifier: str | None = None


class CompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # text, token ids, or a list of one of those (msgspec takes one array type
    # in a union: the list's shape is checked by the route)
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None  # top alternatives per token; 0: the chosen token's only
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


T = TypeVar("T")
# The roles a chat template knows; OpenAI's "developer" is its newer name for system.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _unset(value: Any) -> bool:
    """0, empty or absent: the neutral value of most of these fields."""
    return not value


# field -> (is the value one the engine honours?, what it may be), checked in order
NEUTRAL: dict[str, tuple[Any, str]] = {
    "frequency_penalty": (_unset, "0"),
    "presence_penalty": (_unset, "0"),
    "repetition_penalty": (lambda v: v is None or v == 1, "1"),
    "min_p": (_unset, "0"),
    "min_tokens": (_unset, "0"),
    "logit_bias": (_unset, "empty"),
    "top_logprobs": (_unset, "0 (the log-probability of the chosen token only)"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"}'),
    "tools": (_unset, "empty (no tool calling)"),
    "tool_choice": (lambda v: v in (None, "none"), '"none"'),
    "functions": (_unset, "empty (no tool calling)"),
    "function_call": (lambda v: v in (None, "none"), '"none"'),
    "modalities": (lambda v: v in (None, ["text"]), '["text"]'),
    "audio": (lambda v: v is None, "null (text only)"),
    "prediction": (lambda v: v is None, "null"),
    "reasoning_effort": (lambda v: v is None, "null"),
    "verbosity": (lambda v: v is None, "null"),
    "web_search_options": (lambda v: v is None, "null"),
    "service_tier": (lambda v: v in (None, "auto", "default"), '"auto" or "default"'),
    "store": (_unset, "false (nothing is stored)"),
    "echo": (_unset, "false"),
    "suffix": (_unset, "empty"),
}


def decode(body: bytes, kind: type[T]) -> T:
    """The body as kind; a ValidationError names the parameter that is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        param, message = _located(str(error))
        raise ValidationError(param, message) from None
    except msgspec.DecodeError as error:
        raise ValidationError("body", f"not JSON: {error}") from None


def check_supported(request: ChatCompletionRequest | CompletionRequest) -> None:
    for name, (honoured, neutral) in NEUTRAL.items():
        value = getattr(request, name, None)
        if not honoured(value):
            raise ValidationError(name, f"{value!r} is not supported; only {neutral}")
    options = request.stream_options
    if options is not None:
        if not request.stream:
            raise ValidationError("stream_options", "only with stream: true")
        if options.continuous_usage_stats:
            raise ValidationError("stream_options.continuous_usage_stats",
                                  "not supported; usage comes in the last chunk")
    if isinstance(request, CompletionRequest):
        if request.logprobs:
            raise ValidationError("logprobs", f"{request.logprobs} alternatives are not "
                                  "supported; 0 gives the chosen token's log-probability")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise ValidationError("best_of", "only equal to n")


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The conversation as the chat template takes it: role and text content."""
    if not messages:
        raise ValidationError("messages", "must not be empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES:
            raise ValidationError(f"{where}.role", f"{message.role!r} is not supported; "
                                  f"only {', '.join(ROLES)}")
        for name in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if getattr(message, name):
                raise ValidationError(f"{where}.{name}", "not supported (text only)")
        content = message.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise ValidationError(f"{where}.content", f"part type {kinds.pop()!r} is not "
                                      "supported; only text")
            content = "".join(part.text for part in content)
        entry = {"role": ROLES[message.role], "content": content or ""}
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    return out


def sampling_params(request: ChatCompletionRequest | CompletionRequest,
                    max_tokens: int | None) -> SamplingParams:
    """The engine's parameters; max_tokens None keeps the engine's default
    (the front end then fills the context)."""
    defaults = SamplingParams()
    if request.temperature is not None and math.isnan(request.temperature):
        raise ValidationError("temperature", "must be a number, got NaN")
    stop = request.stop if request.stop is not None else ()
    top_k = request.top_k or 0
    if top_k == -1:  # vLLM's spelling of "every token"
        top_k = 0
    logprobs = (request.logprobs is not None if isinstance(request, CompletionRequest)
                else bool(request.logprobs))
    return SamplingParams(
        max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_k=top_k,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        seed=request.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        n=defaults.n if request.n is None else request.n,
        logprobs=logprobs,
    )


# "Expected `int`, got `str` - at `$.messages[0].role`"
_LOCATED = re.compile(r"^(?P<message>.*?)(?: - at `\$\.?(?P<path>.*)`)?$", re.DOTALL)
_NAMED = re.compile(r"(?:unknown|missing required) field `(?P<name>[^`]*)`")


def _located(text: str) -> tuple[str, str]:
    """msgspec's message -> (the parameter's path, the message without it)."""
    match = _LOCATED.match(text)
    assert match is not None  # the pattern matches any text
    path, message = match["path"] or "", match["message"]
    named = _NAMED.search(message)
    if named is not None:
        path = f"{path}.{named['name']}" if path else named["name"]
    if "unknown field" in message:
        message = "unknown parameter"
    return path or "body", message
