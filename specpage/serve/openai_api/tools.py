"""Tool calling on the chat endpoint: OpenAI's `tools` and `tool_choice`
for a model whose chat template offers tools and writes its calls as
Hermes-style blocks (Qwen2.5, Qwen3, Hermes and the models trained on
their format):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `tool_choice` "required" or a named function: the output is constrained
  (core/grammar.py) to such blocks, each call's JSON to one of the offered
  functions (or the named one) with arguments matching its `parameters`
  schema; one block unless `parallel_tool_calls` (required only);
- "auto": the model writes text or calls as it likes; the calls are parsed
  out of its output (`parse`, or `ToolStream` as it streams);
- "none": the tools go to the template, and no call is parsed.

A model whose template has no tools, or writes its calls otherwise, is a
400 naming `tools`. The response carries OpenAI's `tool_calls` (arguments
as JSON text) with finish reason `tool_calls`.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from specpage.core.grammar import JSON_OPTIONS, Constraint
from specpage.core.request import ValidationError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as the engine uses them."""

    tools: list[dict[str, Any]]  # OpenAI's shape, as the template takes them
    choice: str  # "none", "auto", "required" or the name of the one function to call
    parallel: bool = True
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)  # by function name

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default, or any with tools
        template = template.get("tool_use") or template.get("default") or ""
    return str(template)


def offers_tools(tokenizer: Any) -> bool:
    return "tools" in template_source(tokenizer)


def plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
         tokenizer: Any) -> ToolPlan | None:
    """The request's tools checked against the model (None when it gives
    none, or says never to call them and the template has no tools); a
    ValidationError names the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValidationError("tool_choice", "a tool choice needs tools")
        return None
    if tool_choice == "none" and not offers_tools(tokenizer):
        return None  # tools never to be called change nothing: accepted unread
    if not offers_tools(tokenizer):
        raise ValidationError("tools", "the model's chat template has no tool support")
    if OPEN not in template_source(tokenizer):
        raise ValidationError("tools", "the model's chat template writes tool calls in a "
                              f"format not supported here (only {OPEN} JSON blocks)")
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValidationError(f"{where}.type", 'only "function" tools are supported')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValidationError(f"{where}.function", "must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValidationError(f"{where}.function.name",
                                  "must be 1 to 64 of a-z, A-Z, 0-9, _, . and -")
        if name in parameters:
            raise ValidationError(f"{where}.function.name", f"{name!r} is given twice")
        schema = function.get("parameters", NO_PARAMETERS)
        if not isinstance(schema, dict):
            raise ValidationError(f"{where}.function.parameters", "must be a JSON schema object")
        parameters[name] = schema
    choice = _choice(tool_choice, parameters)
    return ToolPlan(list(tools), choice, parallel is not False, parameters)


def _choice(tool_choice: Any, parameters: dict[str, dict[str, Any]]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in parameters:
            raise ValidationError("tool_choice.function.name",
                                  f"{name!r} is not one of the tools given")
        return str(name)
    raise ValidationError("tool_choice", 'must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}')


def constraint(tool_plan: ToolPlan, tokenizer: Any) -> Constraint | None:
    """The grammar of the output for "required" or a named function: the
    call blocks, each call's JSON one of the functions allowed."""
    if tool_plan.choice in ("none", "auto"):
        return None
    names = list(tool_plan.parameters) if tool_plan.choice == "required" else [tool_plan.choice]
    calls = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": name}, "arguments": tool_plan.parameters[name]},
        "required": ["name", "arguments"], "additionalProperties": False} for name in names],
        "x-guidance": JSON_OPTIONS}  # as json.dumps writes it, no free whitespace
    many = tool_plan.choice == "required" and tool_plan.parallel
    newline = json.dumps("\n")
    lark = "\n".join([
        "start: call" + (f" ({newline} call)*" if many else ""),
        f"call: {_tag(OPEN, tokenizer)} {newline} body {newline} {_tag(CLOSE, tokenizer)}",
        f"body: %json {json.dumps(calls)}",
    ])
    return Constraint("grammar", lark, field="tools")


def _tag(text: str, tokenizer: Any) -> str:
    """A tag in the grammar: the special token where the tokenizer has one
    for it (the model writes that), else the text."""
    special = getattr(tokenizer, "all_special_tokens", None) or []
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    if text in special or text in added:
        return text  # Lark's <name> refers to the special token
    return json.dumps(text)


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a finished output: the call blocks whose JSON
    names a function (with its arguments), and the text around them (None
    when there is none)."""
    calls, kept, at = [], [], 0
    for block in _BLOCK.finditer(text):
        call = _call(block.group(1))
        if call is not None:  # a block that is no call stays text
            calls.append(call)
            kept.append(text[at : block.start()])
            at = block.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[at:]).strip()
    return content or None, calls


def _call(body: str) -> dict[str, Any] | None:
    try:
        found = json.loads(body)
    except ValueError:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("name"), str):
        return None
    arguments = found.get("arguments", found.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": found["name"],
                         "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


class ToolStream:
    """A streamed output split as it comes into text (sent at once, but for
    what may begin a call block) and whole calls (sent when their block
    closes)."""

    def __init__(self) -> None:
        self.held = ""  # a call block begun, or what may begin one
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The text to send now and the calls completed by this piece."""
        self.held += text
        content, calls = "", []
        while self.held:
            start = self.held.find(OPEN)
            if start < 0:
                keep = _partial_open(self.held)
                content += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            content += self.held[:start]
            self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if end < 0:
                break
            block, self.held = self.held[: end + len(CLOSE)], self.held[end + len(CLOSE) :]
            call = _call(block[len(OPEN) : -len(CLOSE)].strip())
            if call is None:
                content += block  # not a call after all: text
            else:
                calls.append(call)
        self.num_calls += len(calls)
        return content, calls

    def finish(self) -> str:
        """What was held back and never became a call: text."""
        rest, self.held = self.held, ""
        return rest


def _partial_open(text: str) -> int:
    """The length of text's longest end that begins OPEN."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls with their arguments as objects, as chat templates
    write them (OpenAI sends them as JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
        out.append(message)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def check_messages(messages: list[dict[str, Any]], tokenizer: Any) -> None:
    """Tool calls and results in a conversation need a template with tools."""
    if offers_tools(tokenizer):
        return
    for i, message in enumerate(messages):
        if message.get("role") == "tool" or message.get("tool_calls"):
            part = "role" if message.get("role") == "tool" else "tool_calls"
            raise ValidationError(f"messages[{i}].{part}",
                                  "the model's chat template has no tool support")
