"""The request bodies of OpenAI's /v1/chat/completions and /v1/completions.

Every field OpenAI's API reference defines is known, with vLLM's extensions
where the engine has them (`top_k`, `min_p`, `min_tokens`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `prompt_logprobs`,
`cache_salt`, `priority`, `chat_template_kwargs`, and structured outputs:
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
`structured_outputs`), so the bodies that common
clients send decode. What is refused and what is accepted unread follows the
unknown-field rule (fields.py): a field that would change the output if
honoured is a `ValidationError` naming it (`NEUTRAL` lists what each known
one may be); one that changes nothing is accepted, logged and listed.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple, TypeVar

import msgspec

from specpage.core import grammar
from specpage.core.chat_template import TemplateOptions
from specpage.core.grammar import Constraint
from specpage.core.request import SamplingParams, ValidationError
from specpage.engine.submission import Prompt, TextPrompt, TokenPrompt
from specpage.serve.openai_api import fields

# vLLM's spelling of "no seed" (its default); OpenAI's API has none.
NO_SEED = -1
# The most alternatives a legacy completion's logprobs may ask for (OpenAI's bound).
MAX_LOGPROBS = 5


# Inside a message, a content part and stream_options an unknown key changes
# nothing: these three are the only types that take one (fields.py).
class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's padding against side channels; none here
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (not offered here)


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str = ""


class Message(msgspec.Struct, frozen=True, kw_only=True):
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
    user: str | None = None  # the caller's end user, for its own logs: ignored (fields.py)
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
    # the prompt's log-probabilities, this many alternatives per position
    # (the request then recomputes its prompt: no prefix-cache hit)
    prompt_logprobs: int | None = None
    # structured outputs (constraint() below): OpenAI's, then vLLM's names
    response_format: dict[str, Any] | None = None
    guided_json: Any = None  # a JSON schema, as an object or as JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # GBNF/EBNF (rules with ::=) or Lark
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer form of the four


class ChatCompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True,
                            kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
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
    # fields.IGNORED: accepted whatever they say
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def template_options(self) -> TemplateOptions:
        return TemplateOptions(variables=self.chat_template_kwargs or {})


class CompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # text, token ids, or a list of texts or of token-id lists (msgspec takes
    # one array type in a union: completion_prompts checks the list's shape)
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None  # top alternatives per token; 0: the chosen token's only
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


T = TypeVar("T", bound=msgspec.Struct)
# The roles a chat template knows; OpenAI's "developer" is its newer name for system.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _unset(value: Any) -> bool:
    """0, empty or absent: the neutral value of most of these fields."""
    return not value


# field -> (is the value one the engine honours?, what it may be), checked in order
NEUTRAL: dict[str, tuple[Any, str]] = {
    "modalities": (lambda v: v in (None, ["text"]), '["text"]'),
    "audio": (lambda v: v is None, "null (text only)"),
    "prediction": (lambda v: v is None, "null"),
    "reasoning_effort": (lambda v: v is None, "null"),
    "verbosity": (lambda v: v is None, "null"),
    "web_search_options": (lambda v: v is None, "null"),
    "suffix": (_unset, "empty"),
}


# (tools' field, the field that says whether to call one): the current
# names and OpenAI's legacy ones
TOOL_FIELDS = (("tools", "tool_choice"), ("functions", "function_call"))
# What the field that chooses a tool may say when none is ever called.
NO_CALL = (None, "none", "auto")
NESTED: dict[str, type[msgspec.Struct]] = {
    "messages": Message, "content": ContentPart, "stream_options": StreamOptions}


def decode(body: bytes, kind: type[T]) -> tuple[T, list[str]]:
    """The body as kind, and the fields in it that change nothing (fields.py)
    by name; a ValidationError names the parameter that is wrong or that
    asks for what is not done."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as error:
        raise ValidationError("body", f"not JSON: {error}") from None
    fields.check_refused(raw)
    ignored = fields.take_ignored(raw, kind) + fields.unknown_nested(raw, NESTED)
    try:
        request = msgspec.convert(raw, type=kind)
    except msgspec.ValidationError as error:
        param, message = _located(str(error))
        raise ValidationError(param, message) from None
    return request, ignored


def check_supported(request: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """Refuses what the engine cannot honour; returns the tool fields that
    are accepted unread (tools the call says never to use)."""
    for name, (honoured, neutral) in NEUTRAL.items():
        value = getattr(request, name, None)
        if not honoured(value):
            raise ValidationError(name, f"{value!r} is not supported; only {neutral}")
    ignored = []
    for tools, choice in TOOL_FIELDS:
        given, chosen = getattr(request, tools, None), getattr(request, choice, None)
        if tools == "tools":  # honoured where the model's template offers them (tools.py)
            continue
        if given and chosen != "none":
            raise ValidationError(tools, f"tool calling is not supported; only with "
                                  f'{choice}: "none"')
        if chosen not in NO_CALL:
            raise ValidationError(choice, f'{chosen!r} is not supported; only "none"')
        ignored += [name for name, value in ((tools, given), (choice, chosen)) if value]
    options = request.stream_options
    if options is not None:
        if not request.stream:
            raise ValidationError("stream_options", "only with stream: true")
        if options.continuous_usage_stats:
            raise ValidationError("stream_options.continuous_usage_stats",
                                  "not supported; usage comes in the last chunk")
    if isinstance(request, CompletionRequest):
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise ValidationError("logprobs", f"must be in 0..{MAX_LOGPROBS}, got "
                                  f"{request.logprobs}")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise ValidationError("best_of", "only equal to n")
    elif request.top_logprobs and not request.logprobs:
        raise ValidationError("top_logprobs", "only with logprobs: true")
    return ignored


class PromptPart(NamedTuple):
    """One prompt of a request and its name in errors (`prompt[1]` in a batch)."""

    field: str
    prompt: Prompt


def completion_prompts(prompt: str | list[int | str | list[int]]) -> list[PromptPart]:
    """A completion's prompts: text, token ids, or a list of either (a batch,
    one choice per prompt and sample)."""
    if isinstance(prompt, str):
        return [PromptPart("prompt", TextPrompt(prompt))]
    if not prompt:
        raise ValidationError("prompt", "must not be empty")
    if all(isinstance(item, int) for item in prompt):
        return [PromptPart("prompt", TokenPrompt(prompt))]  # type: ignore[arg-type]
    if all(isinstance(item, str) for item in prompt):
        return [PromptPart(f"prompt[{i}]", TextPrompt(text))  # type: ignore[arg-type]
                for i, text in enumerate(prompt)]
    if all(isinstance(item, list) for item in prompt):
        return [PromptPart(f"prompt[{i}]", TokenPrompt(ids))  # type: ignore[arg-type]
                for i, ids in enumerate(prompt)]
    raise ValidationError("prompt", "text, token ids, or a list of texts or of token-id "
                          "lists, not a mix")


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: role and text content."""
    if not messages:
        raise ValidationError("messages", "must not be empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES:
            raise ValidationError(f"{where}.role", f"{message.role!r} is not supported; "
                                  f"only {', '.join(ROLES)}")
        for name in ("function_call", "audio"):
            if getattr(message, name):
                raise ValidationError(f"{where}.{name}", "not supported (text only)")
        content = message.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise ValidationError(f"{where}.content", f"part type {kinds.pop()!r} is not "
                                      "supported; only text")
            content = "".join(part.text for part in content)
        entry: dict[str, Any] = {"role": ROLES[message.role], "content": content or ""}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
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
    if isinstance(request, CompletionRequest):
        logprobs, top_logprobs = request.logprobs is not None, request.logprobs or 0
        # echo shows the prompt's log-probabilities with as many alternatives
        echoed = top_logprobs if request.echo and logprobs else None
    else:
        logprobs, top_logprobs = bool(request.logprobs), request.top_logprobs or 0
        echoed = None
    prompt_logprobs = max((n for n in (request.prompt_logprobs, echoed) if n is not None),
                          default=None)
    if request.prompt_logprobs is not None and request.prompt_logprobs < 0:
        prompt_logprobs = request.prompt_logprobs  # SamplingParams names it
    return SamplingParams(
        max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_k=top_k,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        seed=None if request.seed == NO_SEED else request.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        n=defaults.n if request.n is None else request.n,
        logprobs=logprobs,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=(defaults.repetition_penalty if request.repetition_penalty is None
                            else request.repetition_penalty),
        min_p=request.min_p or 0.0,
        min_tokens=request.min_tokens or 0,
        logit_bias=_logit_bias(request.logit_bias),
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings; their range
    and the biases' are SamplingParams' to check."""
    ids = {}
    for key, value in (bias or {}).items():
        try:
            ids[int(key)] = value
        except ValueError:
            raise ValidationError("logit_bias", f"key {key!r} is not a token id") from None
    return ids


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


# vLLM's structured_outputs keys that constrain, and the request field each
# one is the newer spelling of
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                   "grammar": "guided_grammar", "json_object": "json_object"}
# structured_outputs keys that change nothing here: JSON is generated
# without free whitespace whatever they say (core/grammar.py)
STRUCTURED_NEUTRAL = ("disable_fallback", "disable_any_whitespace",
                      "disable_additional_properties", "whitespace_pattern", "backend")


def constraint(request: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
    """What the output must match, from whichever field gives it; a
    ValidationError names the field when it is malformed or when two
    fields each ask for one."""
    found: list[Constraint] = []
    response_format = request.response_format
    if response_format is not None:
        made = _response_format(response_format)
        if made is not None:
            found.append(made)
    for name in fields.HONOURED:
        value = getattr(request, name)
        if value is not None:
            found.append(_guided(name, value, name))
    structured = request.structured_outputs
    if structured is not None:
        if not isinstance(structured, dict):
            raise ValidationError("structured_outputs", "must be an object")
        for key, value in structured.items():
            where = f"structured_outputs.{key}"
            if key in STRUCTURED_NEUTRAL or value in (None, False):
                continue
            if key not in STRUCTURED_KEYS:
                raise ValidationError(where, "not supported; only "
                                      + ", ".join(STRUCTURED_KEYS))
            if key == "json_object":
                found.append(Constraint("json_object", field=where))
            else:
                found.append(_guided(STRUCTURED_KEYS[key], value, where))
    # a client may send one constraint in both of vLLM's spellings
    distinct = [c for i, c in enumerate(found) if all(c.key != d.key for d in found[:i])]
    if len(distinct) > 1:
        raise ValidationError(distinct[1].field, f"only one constraint per request; "
                              f"{distinct[0].field} gives another")
    return distinct[0] if distinct else None


def _response_format(value: dict[str, Any]) -> Constraint | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", field="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValidationError("response_format.json_schema.schema",
                                  "a json_schema response format needs its schema")
        return grammar.json_schema(spec["schema"], "response_format.json_schema.schema")
    raise ValidationError("response_format.type", f"{kind!r} is not supported; only "
                          "text, json_object or json_schema")


def _guided(kind: str, value: Any, field: str) -> Constraint:
    """vLLM's guided_* field `kind`, given as field."""
    if kind == "guided_json":
        return grammar.json_schema(value, field)
    if kind == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ValidationError(field, "must be a list of strings")
        return Constraint("choice", choices=tuple(value), field=field)
    if not isinstance(value, str):
        raise ValidationError(field, "must be a string")
    return Constraint("regex" if kind == "guided_regex" else "grammar", value, field=field)
