"""What evaluation harnesses and OpenAI clients send, on a real daemon: batched
completions (choice i x n + j, usage summed, streamed too), the served names
and their model objects, vLLM's /tokenize and /detokenize,
chat_template_kwargs, and the unknown-field rule (refused with a 400 naming
the field, or accepted, logged once and listed in X-Ignored-Fields)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from specpage.cli import build_parser
from specpage.client import Client
from specpage.commands.serve import served_names
from specpage.config import ConfigError, load_config
from specpage.models.fetch import SOURCE_FILE, hugging_face_id
from specpage.serve.openai_api.listener import served
from tests.serving.test_openai_api import CONVERSATION, NO_EOS, TIMEOUT_S, sse
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GREEDY: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, **NO_EOS}
# A template variable the test's chat template reads, as Qwen3's reads enable_thinking.
THINKING_OFF = "{{ '<|im_start|>system\n/no_think<|im_end|>\n' }}"
VARIABLE = "{% if enable_thinking is defined and not enable_thinking %}" + THINKING_OFF + (
    "{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("openai-compat")
    tokenizer_pair(folder / "models")
    target = folder / "models" / "target"
    template = target / "chat_template.jinja"
    template.write_text(VARIABLE + template.read_text())
    # what the fetch step records for a model it converts
    (target / SOURCE_FILE).write_text(json.dumps({"hugging_face_id": HUB_ID}))
    return folder


@pytest.fixture(scope="module")
def daemon(models: Path) -> Iterator[Daemon]:
    yield from http_daemon(models)


def target(daemon: Daemon) -> str:
    return str(daemon.config.parent / "models" / "target")


def tokenizer(daemon: Daemon) -> Any:
    return AutoTokenizer.from_pretrained(target(daemon))


async def post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        return await http.post(path, json=body)


# ---------------------------------------------------------------- batched completions


async def test_a_batch_answers_each_prompt_and_sample_at_i_times_n_plus_j(
        daemon: Daemon) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    singles = [(await post(daemon, "/v1/completions", {"prompt": p, **GREEDY})).json()
               for p in prompts]
    reply = await post(daemon, "/v1/completions", {"prompt": prompts, "n": 2, **GREEDY})
    assert reply.status_code == 200, reply.text[:300]
    batch = reply.json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    for i, single in enumerate(singles):
        for j in range(2):  # greedy: both samples are the prompt's one answer
            choice = batch["choices"][i * 2 + j]
            assert choice["text"] == single["choices"][0]["text"]
            assert choice["finish_reason"] == "length"
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles) == 7
    assert usage["completion_tokens"] == 2 * 2 * 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert batch["id"] == "cmpl-" + reply.headers["x-request-id"]


async def test_a_batch_of_texts_through_the_sdk_streamed_or_not(daemon: Daemon) -> None:
    prompts = ["Hello there", "The sky is"]
    singles = [(await post(daemon, "/v1/completions", {"prompt": p, **GREEDY})).json()
               ["choices"][0]["text"] for p in prompts]
    async with openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused",
                                  max_retries=0, timeout=TIMEOUT_S) as client:
        reply = await client.completions.create(
            model=HUB_ID, prompt=prompts, max_tokens=4, temperature=0.0, extra_body=NO_EOS)
        assert [c.text for c in reply.choices] == singles
        assert reply.model == HUB_ID  # the name asked for
        stream = await client.completions.create(
            model=HUB_ID, prompt=prompts, max_tokens=4, temperature=0.0, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS)
        texts, reasons, usage = [""] * 4, [None] * 4, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            [choice] = chunk.choices
            assert reasons[choice.index] is None  # nothing after a choice's last chunk
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason
    assert texts == [singles[0], singles[0], singles[1], singles[1]]
    assert reasons == ["length"] * 4
    assert reply.usage is not None and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (reply.usage.prompt_tokens, 16)


async def test_a_batch_past_the_admission_bound_is_refused_whole(daemon: Daemon) -> None:
    # 129 prompts x 2 samples: more places than max_queue (256) holds
    reply = await post(daemon, "/v1/completions", {"prompt": [[5]] * 129, "n": 2})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt"
    # one bad prompt refuses the batch, naming it
    reply = await post(daemon, "/v1/completions", {"prompt": [[5], [49152]], **GREEDY})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt[1]"


async def test_each_prompt_takes_its_place_and_a_batch_is_admitted_whole_or_not(
        models: Path) -> None:
    """One place running, two waiting: with one request running and one
    waiting, a batch of two has room for its first prompt only, so it is
    429 and the prompt admitted is aborted (the step gate holds every step,
    so nothing ends meanwhile)."""
    daemon = Daemon(models, engine="max_num_seqs = 1", server="max_queue = 2", http=True,
                    gate=True)
    daemon.wait_serving()
    gate = daemon.gate
    assert gate is not None
    long = {"max_tokens": 400, "temperature": 0.0, **NO_EOS}
    try:
        async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
            gate.close()
            tasks = [asyncio.ensure_future(http.post("/v1/completions", json={
                "prompt": [5, 6, 7, i], **long})) for i in range(2)]
            await gate.wait_admitted(2)
            await gate.wait_held()
            for _ in range(2):  # a step takes what was admitted, the next schedules it all
                await gate.step()
            async with Client(daemon.address, max_retries=0) as client:
                assert (await client.server_info()).waiting == 1
                reply = await http.post("/v1/completions", json={
                    "prompt": [[8, 9], [10, 11]], **long})
                assert reply.status_code == 429, reply.text[:300]
                await gate.step()  # the abort of the prompt admitted
                info = await client.server_info()
                assert (info.running, info.waiting) == (1, 1)
                assert gate.admitted() == 3  # the two, and the batch's first prompt
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        gate.open()
        assert daemon.stop() == 0


# ---------------------------------------------------------------- served names


async def test_the_served_names_and_their_model_objects(daemon: Daemon) -> None:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [card["id"] for card in listed] == [target(daemon), HUB_ID]
        assert {card["root"] for card in listed} == {target(daemon)}
        card = (await http.get(f"/v1/models/{HUB_ID}")).json()
        assert card == listed[1]
        missing = await http.get("/v1/models/gpt-4o")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        for name in (target(daemon), HUB_ID):
            reply = await http.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "Hi"}], **GREEDY})
            assert reply.status_code == 200 and reply.json()["model"] == name
        unnamed = await http.post("/v1/completions", json={"prompt": "Hi", **GREEDY})
        assert unnamed.json()["model"] == target(daemon)
        wrong = await http.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-4o"})
        assert wrong.status_code == 404


async def test_served_model_name_from_flags_and_environment() -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "org/b"])
    assert served_names(args.served_model_name) == "a,org/b"
    with pytest.raises(ValueError, match="comma"):
        served_names(["a,b"])
    config = load_config(None, env={"SPECPAGE_SERVER_SERVED_MODEL_NAME": "a,org/b"})
    assert served(config).names == ("a", "org/b")
    # by default: the configured name and the checkpoint's Hugging Face id
    assert served(load_config(None, env={})).names == ("smollm2-135m", HUB_ID)
    assert served(load_config(None, env={})).root == HUB_ID
    with pytest.raises(ConfigError, match="served_model_name"):
        load_config(None, env={"SPECPAGE_SERVER_SERVED_MODEL_NAME": "a,,b"})


async def test_a_folder_s_hugging_face_id_comes_from_its_metadata(tmp_path: Path) -> None:
    assert hugging_face_id(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "org/model"}))
    assert hugging_face_id(str(tmp_path)) == "org/model"
    (tmp_path / SOURCE_FILE).write_text(json.dumps({"hugging_face_id": "org/other"}))
    assert hugging_face_id(str(tmp_path)) == "org/other"
    (tmp_path / SOURCE_FILE).unlink()
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "/models/x"}))
    assert hugging_face_id(str(tmp_path)) is None  # a path, not an id


# ---------------------------------------------------------------- tokenize


async def test_tokenize_and_detokenize_as_vllm(daemon: Daemon) -> None:
    tok = tokenizer(daemon)
    reply = (await post(daemon, "/tokenize", {"prompt": "Hello world"})).json()
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert reply == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                     "token_strs": None}
    templated = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    chat = (await post(daemon, "/tokenize", {"messages": CONVERSATION})).json()
    assert chat["tokens"] == list(templated) and chat["count"] == len(templated)
    open_turn = (await post(daemon, "/tokenize", {
        "messages": CONVERSATION, "add_generation_prompt": False,
        "return_token_strs": True})).json()
    closed = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                     return_dict=True)["input_ids"]
    assert open_turn["tokens"] == list(closed)
    assert open_turn["token_strs"] == tok.convert_ids_to_tokens(closed)
    back = (await post(daemon, "/detokenize", {"tokens": list(templated)})).json()
    assert back == {"prompt": tok.decode(templated)}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400,
     "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "a"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    # more bytes than server.max_prompt_tokens (4096) x 128 can hold
    ("/tokenize", {"prompt": "a" * (4096 * 128 + 1)}, 400, "prompt"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [5, 49152]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
])
async def test_bad_tokenize_requests_name_the_field(daemon: Daemon, path: str,
                                                    body: dict[str, Any], status: int,
                                                    param: str) -> None:
    reply = await post(daemon, path, body)
    assert reply.status_code == status, reply.text[:300]
    assert reply.json()["error"]["param"] == param


# ---------------------------------------------------------------- chat_template_kwargs


async def test_chat_template_kwargs_reach_the_template(daemon: Daemon) -> None:
    tok = tokenizer(daemon)
    messages = [{"role": "user", "content": "Hi"}]
    plain = tok.apply_chat_template(messages, add_generation_prompt=True,
                                    return_dict=True)["input_ids"]
    off = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                  enable_thinking=False)["input_ids"]
    assert len(off) > len(plain)  # the variable changes the prompt
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    tokens = (await post(daemon, "/tokenize", {"messages": messages, **kwargs})).json()
    assert tokens["tokens"] == list(off)
    chat = (await post(daemon, "/v1/chat/completions",
                       {"messages": messages, **GREEDY, **kwargs})).json()
    assert chat["usage"]["prompt_tokens"] == len(off)
    taken = await post(daemon, "/v1/chat/completions", {
        "messages": messages, "chat_template_kwargs": {"tokenize": False}})
    assert taken.status_code == 400
    assert taken.json()["error"]["param"] == "chat_template_kwargs.tokenize"


# ---------------------------------------------------------------- the unknown-field rule


CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # structured outputs (tests/serving/test_structured_outputs.py) with a
    # constraint that cannot be honoured, or a kind not offered
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "objct"}}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "[a-z"}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "a", "guided_decoding_backend": "xgrammar",
                         "guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "guided_future_kind": 1}, "guided_future_kind"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}],
                              "tool_choice": "auto"}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "logits_processors": ["x"]}, "logits_processors"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "suffix": "z"}, "suffix"),
    ("/v1/chat/completions", {**CHAT, "n": 65}, "n"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
async def test_a_field_that_would_change_the_output_is_refused(
        daemon: Daemon, path: str, body: dict[str, Any], param: str) -> None:
    reply = await post(daemon, path, body)
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param


async def test_a_field_that_changes_nothing_is_served_logged_once_and_listed(
        daemon: Daemon) -> None:
    body = {"messages": [{"role": "user", "mood": "calm", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        "stream": True, "stream_options": {"include_usage": True, "frequency": "high"},
        "user": "alice", "seed": -1, "tools": [{"type": "function"}], "tool_choice": "none",
        "guided_decoding_backend": "xgrammar", **GREEDY}
    for _ in range(2):
        async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [data async for data in sse(response)]
        assert events[-1] == "[DONE]"
        assert response.headers["x-ignored-fields"].split(", ") == [
            "guided_decoding_backend", "messages[].content[].cache_control",
            "messages[].mood", "stream_options.frequency", "tool_choice", "tools", "user"]
    # logged at WARNING the first time each name is seen, once per process
    lines = [json.loads(line) for line in daemon.log.read_text().splitlines()
             if line.startswith("{")]
    [line] = [line for line in lines if line.get("field") == "messages[].mood"]
    assert line["level"].lower() == "warning"
