"""Request bodies as common OpenAI clients and evaluation harnesses send them,
written down from their sources (field names, nesting and the values they
put by default; prompts and max_tokens kept small), each sent as it is to a
real daemon: it is served (200), or refused with a 400 that names the field
asking for what the daemon cannot honour (the unknown-field rule, README)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from specpage.models.fetch import SOURCE_FILE
from tests.serving.test_openai_api import TIMEOUT_S, sse
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the checkpoint's id: a name served by default
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
          "required": ["answer"], "additionalProperties": False}
# guidance's serialized grammar (llguidance's JSON form) for select(["yes", "no"])
GUIDANCE_GRAMMAR = json.dumps({"grammars": [{"lark_grammar": 'start: "yes" | "no"'}]})
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# (client, what it does, path, body, None if served, else the field the 400 names)
BODIES: list[tuple[str, str, str, dict[str, Any], str | None]] = [
    # openai-python: chat.completions.create / completions.create, keyword
    # arguments as given, NOT_GIVEN left out
    ("openai SDK", "chat, streamed with usage", CHAT, {
        "messages": [SYSTEM, USER], "model": MODEL, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.7}, None),
    ("openai SDK", "chat, max_completion_tokens and seed", CHAT, {
        "messages": [USER], "model": MODEL, "max_completion_tokens": 8, "seed": 1,
        "temperature": 0, "top_p": 1, "n": 2, "user": "user-1234"}, None),
    ("openai SDK", "batched completions", COMPLETIONS, {
        "model": MODEL, "prompt": ["Once upon a time", "The capital of France is"],
        "max_tokens": 8, "n": 2, "temperature": 0}, None),
    ("openai SDK", "JSON mode", CHAT, {
        "messages": [USER], "model": MODEL, "response_format": {"type": "json_object"},
        "max_tokens": 8}, None),
    # LangChain's ChatOpenAI: _get_request_payload, messages by
    # _convert_message_to_dict (content before role), n and stream always
    ("LangChain ChatOpenAI", "invoke", CHAT, {
        "messages": [{"content": "You are terse.", "role": "system"},
                     {"content": "Hi", "role": "user"},
                     {"content": "Hello!", "role": "assistant"},
                     {"content": "Capital of France?", "role": "user"}],
        "model": MODEL, "stream": False, "n": 1, "temperature": 0.7, "max_tokens": 8}, None),
    ("LangChain ChatOpenAI", "stream with stream_usage", CHAT, {
        "messages": [{"content": "Hi", "role": "user"}], "model": MODEL, "stream": True,
        "stream_options": {"include_usage": True}, "n": 1, "temperature": 0.0,
        "max_tokens": 8}, None),
    ("LangChain ChatOpenAI", "bind_tools", CHAT, {
        "messages": [{"content": "Weather in Paris?", "role": "user"}], "model": MODEL,
        "stream": False, "n": 1, "temperature": 0.7, "tools": [WEATHER_TOOL]}, "tools"),
    ("LangChain ChatOpenAI", "with_structured_output (json_schema)", CHAT, {
        "messages": [{"content": "Capital of France?", "role": "user"}], "model": MODEL,
        "stream": False, "n": 1, "temperature": 0.7, "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "Answer", "schema": SCHEMA, "strict": True}},
        "max_tokens": 8}, None),
    ("LangChain ChatOpenAI", "with_structured_output (function_calling)", CHAT, {
        "messages": [{"content": "Capital of France?", "role": "user"}], "model": MODEL,
        "stream": False, "n": 1, "temperature": 0.7, "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {
            "name": "Answer", "description": "", "parameters": SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "Answer"}}}, "tools"),
    # LiteLLM (openai/ and hosted_vllm/ providers): the OpenAI parameters it
    # maps, extra_body merged in; Anthropic-style content parts pass through
    ("LiteLLM", "completion, streamed", CHAT, {
        "model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8, "temperature": 0.2, "top_p": 0.9, "stream": True,
        "stream_options": {"include_usage": True}}, None),
    ("LiteLLM", "content parts with cache_control", CHAT, {
        "model": MODEL, "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief.",
                                            "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        "max_tokens": 8, "user": "litellm-user"}, None),
    ("LiteLLM", "vLLM guided_choice in extra_body", CHAT, {
        "model": MODEL, "messages": [{"role": "user", "content": "Yes or no?"}],
        "max_tokens": 8, "guided_choice": ["yes", "no"]}, None),
    # LlamaIndex's OpenAILike: _get_model_kwargs (model, temperature,
    # max_tokens), completions unless is_chat_model
    ("LlamaIndex OpenAILike", "complete", COMPLETIONS, {
        "prompt": "Paris is", "stream": False, "model": MODEL, "temperature": 0.1,
        "max_tokens": 8}, None),
    ("LlamaIndex OpenAILike", "chat (is_chat_model)", CHAT, {
        "messages": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "Name a color."}],
        "stream": False, "model": MODEL, "temperature": 0.1, "max_tokens": 8}, None),
    ("LlamaIndex OpenAILike", "stream_chat", CHAT, {
        "messages": [{"role": "user", "content": "Name a color."}], "stream": True,
        "model": MODEL, "temperature": 0.1, "max_tokens": 8}, None),
    # Open WebUI: the model's parameters applied to the OpenAI body, its
    # own metadata removed before it is forwarded
    ("Open WebUI", "chat", CHAT, {
        "stream": True, "model": MODEL, "messages": [
            {"role": "system", "content": "You are a friendly assistant."},
            {"role": "user", "content": "Tell me a joke"}],
        "temperature": 0.8, "top_p": 0.9, "max_tokens": 8, "seed": 42,
        "stop": ["<|im_end|>"], "stream_options": {"include_usage": True}}, None),
    ("Open WebUI", "title generation", CHAT, {
        "model": MODEL, "messages": [{"role": "user", "content": (
            "### Task:\nGenerate a concise, 3-5 word title for the chat history.\n"
            "### Chat History:\n<chat_history>\nUSER: Tell me a joke\n</chat_history>")}],
        "stream": False, "max_tokens": 8}, None),
    ("Open WebUI", "an image attached", CHAT, {
        "stream": True, "model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
        "max_tokens": 8}, "messages[0].content"),
    # guidance: OpenAI and vLLM models stream chat with log-probabilities;
    # a grammar goes to vLLM in extra_body, both old and new spellings
    ("guidance", "gen()", CHAT, {
        "model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Count to three:"}]}],
        "logprobs": True, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 8, "temperature": 0.0, "top_p": None}, None),
    ("guidance", "select() / regex on vLLM", CHAT, {
        "model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Pick one:"}]}],
        "logprobs": True, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 8, "guided_decoding_backend": "guidance",
        "guided_grammar": GUIDANCE_GRAMMAR, "structured_outputs": {"grammar": GUIDANCE_GRAMMAR}},
     None),
    ("guidance", "an empty grammar", CHAT, {
        "model": MODEL, "messages": [{"role": "user", "content": "Pick one:"}],
        "max_tokens": 8, "guided_grammar": '{"grammars": []}'}, "guided_grammar"),
    ("guidance", "json() on OpenAI", CHAT, {
        "model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "A JSON answer:"}]}],
        "logprobs": True, "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "json_schema", "schema": SCHEMA, "strict": True}},
        "max_tokens": 8}, None),
    # lm-evaluation-harness: local-completions' and local-chat-completions'
    # _create_payload (generate_until batches prompts; seed 1234)
    ("lm-eval local-completions", "generate_until", COMPLETIONS, {
        "prompt": ["Question: 2+2?\nAnswer:", "Question: 3+3?\nAnswer:"], "model": MODEL,
        "max_tokens": 8, "temperature": 0, "stop": ["\n\n", "Question:"], "seed": 1234},
     None),
    ("lm-eval local-completions", "generate_until, tokenized", COMPLETIONS, {
        "prompt": [[5, 6, 7, 8], [9, 10, 11]], "model": MODEL, "max_tokens": 8,
        "temperature": 0, "stop": ["<|im_end|>"], "seed": 1234}, None),
    ("lm-eval local-completions", "loglikelihood", COMPLETIONS, {
        "model": MODEL, "prompt": [[5, 6, 7, 8]], "temperature": 0, "max_tokens": 1,
        "logprobs": 1, "seed": 1234, "echo": True}, None),
    ("lm-eval local-chat-completions", "generate_until", CHAT, {
        "messages": [{"role": "user", "content": "Question: 2+2?\nAnswer:"}],
        "model": MODEL, "max_tokens": 8, "temperature": 0, "stop": ["<|im_end|>"],
        "seed": 1234}, None),
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    folder = tmp_path_factory.mktemp("openai-clients")
    tokenizer_pair(folder / "models")
    # what the fetch step records, so the checkpoint's id is a name served
    (folder / "models" / "target" / SOURCE_FILE).write_text(
        json.dumps({"hugging_face_id": MODEL}))
    yield from http_daemon(folder)


def choices(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], str | list) else 1
    return prompts * body.get("n", 1)


@pytest.mark.parametrize(("client", "doing", "path", "body", "refused"), BODIES,
                         ids=[f"{client}: {doing}" for client, doing, *_ in BODIES])
async def test_a_client_s_body_is_served_or_refused_naming_the_field(
        daemon: Daemon, client: str, doing: str, path: str, body: dict[str, Any],
        refused: str | None) -> None:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
            http.stream("POST", path, json=body) as response:
        if refused is not None:
            assert response.status_code == 400, (await response.aread())[:300]
            error = json.loads(await response.aread())["error"]
            assert error["param"] == refused, error
            return
        assert response.status_code == 200, (await response.aread())[:300]
        if body.get("stream"):
            events = [data async for data in sse(response)]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(data) for data in events[:-1]]
            indices = {c["index"] for chunk in chunks for c in chunk["choices"]}
            assert indices == set(range(choices(body)))
            return
        reply = json.loads(await response.aread())
    assert [c["index"] for c in reply["choices"]] == list(range(choices(body)))
    assert reply["model"] == MODEL
    assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"])
