"""Structured outputs on a real daemon, as clients ask for them: the openai
SDK's `.parse()` with a pydantic model, LangChain's `with_structured_output`,
vLLM's `guided_*` and `structured_outputs` fields on both endpoints, and
gRPC's Constraint message. The target is a tiny random model with SmolLM2's
tokenizer: it prefers nothing, so every output that holds, holds by the
constraint alone. A bad constraint is refused naming its field, and the
daemon serves a stream meanwhile."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import grpc
import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from specpage.client import Client, IncompleteError
from tests.serving.test_openai_api import TIMEOUT_S, sse
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 300  # more than any constraint here can take


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]
    tags: list[Literal["a", "b"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    folder = tmp_path_factory.mktemp("structured")
    tokenizer_pair(folder / "models")
    yield from http_daemon(folder)


@pytest.fixture(scope="module")
def served_name(daemon: Daemon) -> str:
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused") as sdk:
        return sdk.models.list().data[0].id


async def post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        return await http.post(path, json=body)


async def test_the_sdks_parse_returns_the_pydantic_model(daemon: Daemon,
                                                         served_name: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused",
                                  max_retries=0, timeout=TIMEOUT_S) as sdk:
        for temperature in (0.0, 1.0):
            reply = await sdk.chat.completions.parse(
                model=served_name, messages=MESSAGES, response_format=Person,  # type: ignore[arg-type]
                temperature=temperature, max_tokens=MAX_TOKENS, seed=5, n=2)
            for choice in reply.choices:
                assert choice.finish_reason == "stop"
                assert isinstance(choice.message.parsed, Person)
                assert Person.model_validate_json(choice.message.content or "") == (
                    choice.message.parsed)


async def test_langchains_with_structured_output_returns_the_model(daemon: Daemon,
                                                                   served_name: str) -> None:
    chat = ChatOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", model=served_name,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=TIMEOUT_S)
    structured = chat.with_structured_output(Person, method="json_schema")
    answer = await structured.ainvoke(MESSAGES)
    assert isinstance(answer, Person)
    answers = await structured.abatch([MESSAGES, [{"role": "user", "content": "Another one."}]])
    assert all(isinstance(a, Person) for a in answers)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "holds"), [
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", t) is not None),
    ({"guided_grammar": 'root ::= "<" [xy]+ ">"'},
     lambda t: re.fullmatch(r"<[xy]+>", t) is not None),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"], "additionalProperties": False}},
     lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
    ({"structured_outputs": {"json": json.dumps({"enum": [1, 2, 3]})}},
     lambda t: json.loads(t) in (1, 2, 3)),
])
async def test_vllms_fields_constrain_both_endpoints(daemon: Daemon, path: str,
                                                     fields: dict[str, Any], holds) -> None:
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1, "n": 3,
                            **fields}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Answer:"})
    response = await post(daemon, path, body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        assert choice["finish_reason"] == "stop" and holds(text), text


async def test_a_constrained_stream_joins_to_a_valid_object(daemon: Daemon) -> None:
    schema = Person.model_json_schema()
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "Person", "schema": schema}}}
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
            http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        events = [json.loads(data) async for data in sse(response) if data != "[DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"])
    Person.model_validate_json(text)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_whatever": "x"}, "guided_whatever"),
])
async def test_a_bad_constraint_is_refused_naming_its_field_while_a_stream_runs(
        daemon: Daemon, fields: dict[str, Any], param: str) -> None:
    running = {"messages": MESSAGES, "max_tokens": 24, "stream": True, "ignore_eos": True,
               "temperature": 0}

    async def stream() -> list[str]:
        async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
                http.stream("POST", CHAT, json=running) as response:
            return [data async for data in sse(response)]

    streaming = asyncio.ensure_future(stream())
    response = await post(daemon, CHAT, {"messages": MESSAGES, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    events = await streaming
    assert events[-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]
              if json.loads(e)["choices"]]
    assert finals[-1] == "length"


async def test_grpc_constrains_with_its_constraint_message(daemon: Daemon) -> None:
    async with Client(daemon.address) as client:
        completion = await client.complete(
            "Pick:", max_tokens=MAX_TOKENS, temperature=1.0, seed=2, n=3,
            constraint={"choice": ["alpha", "beta"]})
        assert {s.text for s in completion.samples} <= {"alpha", "beta"}
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
                  "required": ["n"], "additionalProperties": False}
        completion = await client.complete("JSON:", max_tokens=MAX_TOKENS, temperature=0,
                                           constraint={"json_schema": schema})
        assert json.loads(completion.samples[0].text)["n"] in range(10)
        assert completion.samples[0].finish_reason == "stop"
        with pytest.raises(IncompleteError) as caught:
            await client.complete("x", max_tokens=4, constraint={"regex": "("})
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "constraint.regex" in (caught.value.details() or "")
