"""Tool calling, as the openai SDK asks for it, on a real daemon whose
tiny random target has SmolLM2's tokenizer and a Hermes-style chat template
with tools (as Qwen2.5's writes them: <tool_call> JSON blocks). With
tool_choice "required" or a named function the calls are the grammar's, so
even a random model calls the functions offered with arguments that match
their schemas; "auto" parses whatever calls the model writes. A model
whose template has no tools is refused naming `tools`
(tests/serving/test_tool_parsing.py: the parsing itself)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.serving.test_openai_api import TIMEOUT_S, sse
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT = "/v1/chat/completions"
# Hermes-style, as Qwen2.5's template writes tools, calls and results
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    folder = tmp_path_factory.mktemp("tools")
    tokenizer_pair(folder / "models")
    (folder / "models" / "target" / "chat_template.jinja").write_text(TEMPLATE)
    yield from http_daemon(folder)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """SmolLM2's own template: no tools."""
    folder = tmp_path_factory.mktemp("no-tools")
    tokenizer_pair(folder / "models")
    yield from http_daemon(folder)


def sdk(daemon: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused",
                              max_retries=0, timeout=TIMEOUT_S)


def check_call(call: Any, allowed: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_calls_offered_functions_with_valid_arguments(daemon: Daemon) -> None:
    async with sdk(daemon) as client:
        for temperature in (0.0, 1.0):
            reply = await client.chat.completions.create(
                model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=temperature,
                seed=3, n=2)
            for choice in reply.choices:
                assert choice.finish_reason == "tool_calls"
                assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
                check_call(choice.message.tool_calls[0], set(SCHEMAS))
        # parallel calls: as many as the model writes (a random one may go on
        # to max_tokens), every whole one valid
        reply = await client.chat.completions.create(
            model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, temperature=1.0, seed=4)
        choice = reply.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call, set(SCHEMAS))


async def test_a_named_function_is_called_once(daemon: Daemon) -> None:
    async with sdk(daemon) as client:
        reply = await client.chat.completions.create(
            model="", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    check_call(calls[0], {"get_time"})
    assert reply.choices[0].message.content is None


async def test_a_streamed_call_is_the_non_streamed_one(daemon: Daemon) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, "temperature": 0}
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        whole = (await http.post(CHAT, json=body)).json()["choices"][0]
        async with http.stream("POST", CHAT, json={**body, "stream": True}) as response:
            events = [json.loads(d) async for d in sse(response) if d != "[DONE]"]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    streamed = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in streamed] == [
        (i, c["function"]) for i, c in enumerate(whole["message"]["tool_calls"])]
    assert len(streamed) == 1  # parallel_tool_calls false: one call
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""


async def test_auto_lets_the_model_answer_and_a_conversation_carries_calls(
        daemon: Daemon) -> None:
    conversation = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris",
                                                            "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    async with sdk(daemon) as client:
        reply = await client.chat.completions.create(
            model="", messages=conversation, tools=TOOLS, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    choice = reply.choices[0]
    # a random model writes text; whatever it writes is content or calls
    assert choice.message.content is not None or choice.message.tool_calls
    assert reply.usage is not None and reply.usage.prompt_tokens > 40


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
])
async def test_bad_tools_are_refused_naming_the_field(daemon: Daemon, body: dict[str, Any],
                                                      param: str) -> None:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        reply = await http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


async def test_a_template_without_tools_is_refused_naming_tools(plain: Daemon) -> None:
    async with httpx.AsyncClient(base_url=plain.http_url, timeout=TIMEOUT_S) as http:
        reply = await http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS,
                                            "max_tokens": 4})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "tools" and "no tool support" in error["message"]
        # tools the call says never to use change nothing: accepted unread
        reply = await http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS,
                                            "tool_choice": "none", "max_tokens": 4})
        assert reply.status_code == 200
        assert reply.headers["X-Ignored-Fields"] == "tool_choice, tools"
