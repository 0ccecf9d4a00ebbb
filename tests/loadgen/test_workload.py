"""loadgen --requests-file: real requests from JSONL or ShareGPT JSON.

Parsing both shapes, errors that name the file and line, seeded shuffled passes
over the file, a request's own max_tokens, and what goes over the wire: gRPC
(chat=true for a lone user message, refusing conversations it cannot carry) and
the OpenAI API (the whole conversation to /v1/chat/completions), against
loopback fakes.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadgen.backend import RequestOptions
from loadgen.cli import build_parser, main
from loadgen.client import build_request
from loadgen.errors import UsageError
from loadgen.openai_client import build_body
from loadgen.options import workload
from loadgen.prompts import Conversation
from loadgen.request_file import read_request_file
from loadgen.schedule import Bounds, plan_open_loop
from loadgen.workload import Workload
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

BASE = ["run", "--no-selfcheck", "--no-progress", "--no-plots", "--health-timeout", "0"]
WORKLOADS = Path(__file__).resolve().parents[2] / "bench" / "workloads"


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def workload_of(*flags: str) -> Workload:
    return workload(build_parser().parse_args(["run", *flags]))


# ---------------------------------------------------------------- parsing


def test_jsonl_gives_chat_and_text_requests(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        json.dumps({"kind": "qa", "messages": [user("What is 2+2?")], "max_tokens": 7}) + "\n"
        "\n"  # blank lines are skipped, and still counted for the line numbers
        + json.dumps({"id": "ignored", "prompt": "Once upon a time"}) + "\n"
        + json.dumps({"messages": [{"role": "system", "content": "Be brief."}, user("Hi"),
                                   {"role": "assistant", "content": "Hello!"}, user("Bye")]})
        + "\n"
    )
    requests = read_request_file(str(path)).requests
    assert [r.where for r in requests] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    first, second, third = requests
    assert first.prompt == Conversation((("user", "What is 2+2?"),))
    assert (first.max_tokens, first.kind) == (7, "qa")
    assert (second.prompt, second.max_tokens, second.kind) == ("Once upon a time", None, None)
    assert isinstance(third.prompt, Conversation)
    assert [role for role, _ in third.prompt.messages] == ["system", "user", "assistant", "user"]
    assert third.prompt.words() == 5 and third.prompt.lone_user_text() is None
    assert first.prompt.lone_user_text() == "What is 2+2?"


def test_sharegpt_keeps_each_conversation_up_to_its_last_human_turn(tmp_path):
    entries = [
        {"id": "a", "conversations": [
            {"from": "system", "value": "You are kind."},
            {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."},
            {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Green."}]},
        {"id": "no-question", "conversations": [{"from": "gpt", "value": "Hello."}]},
        {"id": "empty", "conversations": []},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}], "max_tokens": 9},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries, indent=2))
    parsed = read_request_file(str(path))
    assert parsed.skipped == 2
    first, second = parsed.requests
    assert first.prompt == Conversation((
        ("system", "You are kind."), ("user", "Name a colour."), ("assistant", "Blue."),
        ("user", "Another?"),
    ))
    assert first.max_tokens is None  # the answer's length is not a token count
    assert second.prompt == Conversation((("user", "Hi"),)) and second.max_tokens == 9
    # Each entry is named by the line it starts on, and its place in the array.
    lines = path.read_text().splitlines()
    assert first.where == f"{path}:2 (entry 0)" and lines[1].strip() == "{"
    number = int(second.where.split(":")[-1].split()[0])
    assert second.where.endswith("(entry 3)") and '"b"' in lines[number]
    # The same conversation objects as JSON lines read alike.
    lined = write_jsonl(tmp_path / "sharegpt.jsonl", entries)
    assert [r.prompt for r in read_request_file(str(lined)).requests] == [
        first.prompt, second.prompt
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "w.jsonl:2: not JSON"),
        ("[1, 2]", "w.jsonl:2: each request must be a JSON object"),
        ('{"max_tokens": 3}', "give exactly one of messages, prompt, conversations"),
        ('{"prompt": "a", "messages": []}', "give exactly one of"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
        ('{"prompt": "a", "max_tokens": "5"}', "max_tokens must be an integer >= 1"),
        ('{"prompt": "a", "max_tokens": true}', "max_tokens must be an integer >= 1"),
        ('{"prompt": "a", "kind": 3}', "kind must be a string"),
        ('{"messages": []}', "messages must be a non-empty list"),
        ('{"messages": ["hi"]}', "messages[0] must be an object"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0]: role must be"),
        ('{"messages": [{"role": "user", "content": 5}]}', "messages[0]: content must be"),
        ('{"messages": [{"role": "user"}]}', "content must be a string"),
        ('{"messages": [{"role": "user", "content": "x", "name": "n"}]}', "unknown key(s) name"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", '
         '"content": "y"}]}', "the last message must be the user's"),
        ('{"conversations": {"from": "human"}}', "conversations must be a list"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "conversations[0]: from must"),
        ('{"conversations": [{"from": "human", "value": null}]}', "value must be a string"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(line, message, tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UsageError) as error:
        read_request_file(str(path))
    assert message in str(error.value) and f"--requests-file {path}:2" in str(error.value)
    # The command line turns it into one line on stderr and exit status 2.
    assert main([*BASE, "--rate", "5", "--requests", "2", "--requests-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[{"prompt": "a"},\n {"prompt": "b"},\n]', "x.json:3: not JSON (Expecting value)"),
        ('[{"prompt": "a"},\n {"prompt": "b"}', "x.json:2: not JSON (expected ',' or one final"),
        ('[{"prompt": "a"}] extra', "x.json:1: not JSON (expected ','"),
        ('[{"prompt": "a"},\n\n {"prompt": 1}]', "x.json:3 (entry 1): prompt must be"),
        ('[\n{"conversations": [{"from": "human"}]}]', "x.json:2 (entry 0): conversations[0]"),
        ("[]", "x.json holds no requests"),
        ('[{"conversations": [{"from": "gpt", "value": "x"}]}]',
         "holds no requests (1 conversations without a human turn)"),
    ],
)
def test_bad_json_arrays_are_named_by_line_and_entry(text, message, tmp_path):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(UsageError, match="--requests-file") as error:
        read_request_file(str(path))
    assert message in str(error.value)


def test_unreadable_and_empty_files(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        read_request_file(str(tmp_path / "missing.jsonl"))
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(UsageError, match="holds no requests"):
        read_request_file(str(tmp_path / "blank.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(UsageError, match="cannot read"):
        read_request_file(str(tmp_path / "latin1.jsonl"))


def test_the_bench_workloads_parse():
    grounded = read_request_file(str(WORKLOADS / "grounded.jsonl")).requests
    chat = read_request_file(str(WORKLOADS / "chat.jsonl")).requests
    assert len(grounded) == 32 and len(chat) == 16
    kinds = {r.kind for r in grounded}
    assert kinds == {"summary", "rewrite", "extraction", "table", "code", "qa", "multi_turn"}
    assert {r.kind for r in chat} == {"chat"}
    for request in (*grounded, *chat):
        assert request.max_tokens is not None and 128 <= request.max_tokens <= 256
        assert isinstance(request.prompt, Conversation)
        single = request.prompt.lone_user_text() is not None
        assert single == (request.kind != "multi_turn")


# ---------------------------------------------------------------- sampling


def items(work: Workload, count: int) -> list[str | None]:
    return [work.request(i, False, 0.0).item for i in range(count)]


def test_seeded_shuffled_passes_send_every_request_once_per_pass(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt": f"request {i}"} for i in range(7)])
    first = items(workload_of("--requests-file", str(path), "--seed", "5"), 21)
    again = items(workload_of("--requests-file", str(path), "--seed", "5"), 21)
    other = items(workload_of("--requests-file", str(path), "--seed", "6"), 21)
    assert first == again and first != other
    every = {f"{path}:{n}" for n in range(1, 8)}
    passes = [first[0:7], first[7:14], first[14:21]]
    assert all(set(one) == every for one in passes)  # each pass is a permutation
    assert passes[0] != passes[1]  # and each pass has its own order
    # Request i is the same whatever the request count or the order they are made in.
    work = workload_of("--requests-file", str(path), "--seed", "5")
    assert [work.request(i, False, 0.0).item for i in reversed(range(21))] == first[::-1]


def test_the_same_requests_at_any_rate(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt": f"p{i}", "max_tokens": i + 1}
                                              for i in range(5)])
    work = workload_of("--requests-file", str(path), "--seed", "2")
    bounds = Bounds(requests=12, duration_s=None, warmup=2)

    def plan(rate: float) -> list[tuple]:
        offsets = (i / rate for i in range(1000))
        return [(s.prompt, s.max_tokens, s.seed, s.warmup)
                for s in plan_open_loop(work, offsets, bounds)]

    assert plan(1.0) == plan(50.0) and len(plan(1.0)) == 14


def test_a_requests_own_max_tokens_overrides_the_output_len(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [
        {"prompt": "has its own", "max_tokens": 3}, {"prompt": "drawn"},
    ])
    work = workload_of("--requests-file", str(path), "--output-len", "uniform:100,200",
                       "--seed", "1")
    drawn = dataclasses.replace(work, requests=None)  # the same draws, without the file
    for index in range(8):
        spec = work.request(index, False, 0.0)
        if spec.prompt == "has its own":
            assert spec.max_tokens == 3
        else:
            assert spec.max_tokens == drawn.request(index, False, 0.0).max_tokens
            assert 100 <= spec.max_tokens <= 200
        # Nothing else the request draws changes with the file.
        assert spec.seed == drawn.request(index, False, 0.0).seed
    # The self-check sizes its probes by the lengths the file asks for.
    assert work.mean_output_len() == (3 + 150) / 2 and drawn.mean_output_len() == 150


# ---------------------------------------------------------------- requests on the wire


def test_grpc_sends_a_lone_user_message_as_chat_and_text_prompts_as_chat_says(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [
        {"messages": [user("Summarize: cats sleep a lot.")], "max_tokens": 4},
        {"prompt": "plain text"},
    ])
    for chat in (False, True):
        work = workload_of("--requests-file", str(path), "--seed", "0")
        sent = {}
        for index in range(2):
            spec = work.request(index, False, 0.0)
            request = build_request(spec, RequestOptions(chat=chat), f"r{index}")
            sent[request.text] = (request.chat, request.sampling.max_tokens)
        assert sent["Summarize: cats sleep a lot."] == (True, 4)  # always chat
        assert sent["plain text"][0] is chat


def test_openai_sends_the_whole_conversation_to_chat(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, user("Hi"),
                {"role": "assistant", "content": "Hello!"}, user("Now shorter.")]
    path = write_jsonl(tmp_path / "w.jsonl", [{"messages": messages, "max_tokens": 5}])
    spec = workload_of("--requests-file", str(path)).request(0, False, 0.0)
    path_, body = build_body(spec, RequestOptions(), "m")
    assert path_ == "/v1/chat/completions"
    assert body["messages"] == messages and body["max_tokens"] == 5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompts-file", "{file}"], "are both prompt sources"),
        (["--prefix-fraction", "0.5"], "--prefix-fraction prepends prefixes"),
    ],
)
def test_flags_that_do_not_mix_with_a_requests_file(flags, message, tmp_path, capsys):
    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt": "a"}])
    flags = [flag.format(file=path) for flag in flags]
    assert main([*BASE, "--rate", "5", "--requests", "2", "--requests-file", str(path),
                 *flags]) == 2
    trace = write_jsonl(tmp_path / "t.jsonl", [{"offset_s": 0, "prompt_len": 2,
                                                "output_len": 2}])
    assert main([*BASE, "--trace", str(trace), "--requests-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "--trace brings its own prompts" in err


def test_grpc_refuses_a_conversation_it_cannot_carry_naming_the_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "w.jsonl", [
        {"messages": [user("one")]},
        {"messages": [{"role": "system", "content": "s"}, user("two")]},
    ])
    assert main([*BASE, "--rate", "5", "--requests", "2", "--requests-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: a conversation of 2 messages (system, user) cannot go over gRPC" in err
    assert "--api openai" in err
    assert main(["selfcheck", "--requests-file", str(path)]) == 2  # its null target is gRPC
    assert "cannot go over gRPC" in capsys.readouterr().err
    assert main(["selfcheck", "--requests-file", str(path), "--chat"]) == 2
    # --chat is accepted with a requests file: its text prompts use the template.
    assert workload_of("--requests-file", str(path), "--chat").requests is not None


class Echo(pb_grpc.GenerationServicer):
    """A threaded fake: one token per chunk, as many as max_tokens."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        for count in range(1, request.sampling.max_tokens + 1):
            yield pb.GenerateEvent(chunk=pb.Chunk(token_ids=[5], num_tokens=count))
        usage = pb.Usage(prompt_tokens=len(request.text.split()),
                         completion_tokens=request.sampling.max_tokens)
        yield pb.GenerateEvent(final=pb.Final(usage=usage, finish_reason="length"))


@pytest.fixture
def echo_server() -> Iterator[tuple[Echo, str]]:
    servicer = Echo()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None).wait()


def test_a_grpc_run_sends_the_files_requests_and_records_where_they_came_from(
    echo_server, tmp_path
):
    servicer, address = echo_server
    path = write_jsonl(tmp_path / "w.jsonl", [
        {"kind": "summary", "messages": [user("Summarize this text, please.")], "max_tokens": 3},
        {"kind": "chat", "messages": [user("Tell me a joke.")]},
        {"prompt": "raw text prompt", "max_tokens": 2},
    ])
    out = tmp_path / "out"
    assert main([*BASE, "--target", address, "--rate", "50", "--requests", "6",
                 "--output-len", "4", "--requests-file", str(path), "--seed", "3",
                 "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["counts"]["completed"] == 6
    assert report["config"]["requests_file"] == str(path)
    by_text = {r.text: r for r in servicer.requests}
    assert set(by_text) == {"Summarize this text, please.", "Tell me a joke.", "raw text prompt"}
    assert by_text["Summarize this text, please."].chat and by_text["Tell me a joke."].chat
    assert not by_text["raw text prompt"].chat
    expected = {f"{path}:1": ("summary", 3, 4), f"{path}:2": ("chat", 4, 4),
                f"{path}:3": (None, 2, 3)}
    for record in report["records"]:
        kind, max_tokens, words = expected[record["item"]]
        assert (record["kind"], record["max_tokens"], record["prompt_len"]) == (
            kind, max_tokens, words
        )
        assert record["num_tokens"] == max_tokens
    assert sorted(r["item"] for r in report["records"]) == sorted([*expected] * 2)  # 2 passes
    header = (out / "records.csv").read_text().splitlines()[0].split(",")
    assert "item" in header and "kind" in header


class ChatServer:
    """An OpenAI-compatible fake on 127.0.0.1, in a thread of its own (main() runs
    its own event loop): streams max_tokens one-token chunks and the usage."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict]] = []
        app = Starlette(routes=[
            Route("/health", lambda request: Response()),
            Route("/v1/models", lambda request: JSONResponse({"data": [{"id": "fake"}]})),
            Route("/v1/completions", self.complete, methods=["POST"]),
            Route("/v1/chat/completions", self.complete, methods=["POST"]),
        ])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60  # a bound on a hang, not on the speed
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append((request.url.path, body))
        chat = request.url.path.endswith("/chat/completions")

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {
                "index": 0, "text": text}
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        usage = {"prompt_tokens": 10, "completion_tokens": body["max_tokens"]}
        events = [chunk("x") for _ in range(body["max_tokens"])]
        events += [f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n", "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")


def test_an_openai_run_sends_conversations_to_chat_and_prompts_to_completions(tmp_path):
    conversation = [user("Here is a text."), {"role": "assistant", "content": "A version."},
                    user("Now make it shorter.")]
    path = write_jsonl(tmp_path / "w.jsonl", [
        {"kind": "multi_turn", "messages": conversation, "max_tokens": 3},
        {"prompt": "complete me", "max_tokens": 2},
    ])
    out = tmp_path / "out"
    fake = ChatServer()
    with fake as url:
        assert main([*BASE, "--api", "openai", "--target", url, "--rate", "50",
                     "--requests", "4", "--requests-file", str(path), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["counts"]["completed"] == 4
    assert report["target"]["endpoints"] == {"/v1/chat/completions": 2, "/v1/completions": 2}
    chats = [body for where, body in fake.bodies if where == "/v1/chat/completions"]
    texts = [body for where, body in fake.bodies if where == "/v1/completions"]
    assert all(body["messages"] == conversation and body["max_tokens"] == 3 for body in chats)
    assert all(body["prompt"] == "complete me" and body["max_tokens"] == 2 for body in texts)
    assert {r["kind"] for r in report["records"]} == {"multi_turn", None}
    assert all(r["num_tokens"] == r["max_tokens"] for r in report["records"])
