"""`specpage chat`: a multi-turn chat at the terminal, in-process or with a running daemon.

The conversation is kept as messages and each turn sends all of it, rendered by
the model's chat template. In-process, the tokenizer renders it here; with --url
the daemon's OpenAI-compatible /v1/chat/completions renders it, as it does for
any client. (gRPC Generate takes one text per call, wrapped as a single user
message, and this client has no tokenizer to render a whole conversation.)
Type /reset to start over, /exit or Ctrl-D to leave.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import httpx

from specpage.core.chat_template import chat_token_ids

PROMPT = "> "
EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"
HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) leaves"
NUM_BLOCKS = 512  # in-process KV blocks: as `specpage generate` keeps
HTTP_TIMEOUT_S = 300.0  # one reply, from sending to its last token
Message = dict[str, str]


class ChatBackend(Protocol):
    def reply(self, messages: list[Message]) -> Iterator[str]:
        """The assistant's next message, as text deltas while it is generated."""

    def rendered(self, messages: list[Message]) -> str:
        """What the model is given for these messages (--show-prompt)."""


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(name, help="chat with a model at the terminal", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m",
                        help="in-process: HF folder, .gguf or a known name (needs a chat template)")
    parser.add_argument("--draft", help="in-process draft model; none: no speculation")
    parser.add_argument("--dtype", help="in-process: fp32 (CPU default), bf16, fp16")
    parser.add_argument("--url", help="a running daemon's HTTP front, http://HOST:PORT "
                                      "(server.http_port), instead of in-process")
    parser.add_argument("--token", help="bearer token for --url")
    parser.add_argument("--system", help="a system message opening the conversation")
    parser.add_argument("--max-tokens", type=int, default=256, help="per reply")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--show-prompt", action="store_true",
                        help="print what the model is given each turn, on stderr")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    backend = _remote(args) if args.url else _local(args)
    return converse(backend, args.system, args.show_prompt)


def converse(backend: ChatBackend, system: str | None, show_prompt: bool) -> int:
    """The read-reply loop; returns the exit status (0 on /exit, EOF or Ctrl-C)."""
    opening: list[Message] = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            return 0
        if line in EXIT_COMMANDS:
            return 0
        if line == RESET_COMMAND:
            messages = list(opening)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line:
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {HELP}", file=sys.stderr)
            continue
        turn = [*messages, {"role": "user", "content": line}]
        if show_prompt:
            print(f"--- prompt ---\n{backend.rendered(turn)}\n--- end of prompt ---",
                  file=sys.stderr)
        answer = _stream_reply(backend, turn)
        if answer is not None:  # a failed or interrupted turn leaves no trace
            messages = [*turn, {"role": "assistant", "content": answer}]


def _stream_reply(backend: ChatBackend, turn: list[Message]) -> str | None:
    pieces: list[str] = []
    try:
        for delta in backend.reply(turn):
            pieces.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("\n(interrupted; this turn is dropped)", file=sys.stderr)
        return None
    except ChatError as error:
        print(f"\nerror: {error}", file=sys.stderr)
        return None
    sys.stdout.write("\n")
    return "".join(pieces)


class ChatError(Exception):
    """A turn failed (the server refused it, or could not be reached); the chat goes on."""


class LocalChat:
    """The model in this process; the tokenizer's chat template renders each turn."""

    def __init__(self, llm: Any, params: Any) -> None:
        self.llm = llm
        self.params = params
        self._ids = 0

    def _token_ids(self, messages: list[Message]) -> list[int]:
        return chat_token_ids(self.llm.tokenizer, messages)

    def rendered(self, messages: list[Message]) -> str:
        return str(self.llm.tokenizer.decode(self._token_ids(messages)))

    def reply(self, messages: list[Message]) -> Iterator[str]:
        engine = self.llm.engine
        self._ids += 1
        request_id = f"chat-{self._ids}"
        engine.add_request(request_id, self._token_ids(messages), self.params)
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id == request_id and out.index == 0 and out.text:
                        yield out.text
        finally:
            # Ctrl-C mid-reply: the request leaves at the next step instead of running on.
            if engine.abort(request_id):
                while engine.has_unfinished():
                    engine.step()


class RemoteChat:
    """A daemon's /v1/chat/completions, streamed; the server renders each turn."""

    def __init__(self, url: str, token: str | None, sampling: dict[str, Any]) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                  timeout=HTTP_TIMEOUT_S)
        self.sampling = sampling
        self.model = self._first_model()

    def _first_model(self) -> str:
        try:
            reply = self._http.get("/v1/models")
            reply.raise_for_status()
            return str(reply.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as error:
            raise ValueError(f"--url: cannot list the models at {self._http.base_url}: "
                             f"{error}") from None

    def rendered(self, messages: list[Message]) -> str:
        return json.dumps(messages, indent=1, ensure_ascii=False)

    def reply(self, messages: list[Message]) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, **self.sampling}
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise ChatError(f"HTTP {response.status_code}: "
                                    f"{_error_message(response.read())}")
                for line in response.iter_lines():
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                    if not data:
                        continue
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ChatError(_error_message(data.encode()))
                    for choice in chunk.get("choices") or ():
                        if choice.get("index", 0) == 0 and choice["delta"].get("content"):
                            yield choice["delta"]["content"]
        except httpx.HTTPError as error:
            raise ChatError(f"{type(error).__name__}: {error}") from None
        raise ChatError("the stream ended before its last event")


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error", {})
        return str(error.get("message", error))
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace").strip()


def _local(args: argparse.Namespace) -> LocalChat:
    from specpage.core.request import SamplingParams
    from specpage.engine import EngineConfig
    from specpage.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    params.validate()
    config = EngineConfig(num_blocks=NUM_BLOCKS)
    llm = LLM(args.model, args.draft, config, dtype=args.dtype)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"{args.model} has no chat template to render a conversation with")
    return LocalChat(llm, params)


def _remote(args: argparse.Namespace) -> RemoteChat:
    if args.draft or args.dtype:
        print("specpage chat: --draft and --dtype are ignored with --url: the daemon runs "
              "its own models", file=sys.stderr)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return RemoteChat(args.url, args.token, sampling)
