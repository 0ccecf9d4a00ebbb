"""Real requests from a file (--requests-file): chat conversations or text prompts.

Two shapes, told apart by the file's first character. JSON Lines, one object a line:

    {"messages": [{"role": "user", "content": "Summarize: ..."}], "max_tokens": 200}
    {"prompt": "Once upon a time", "max_tokens": 64}
    {"kind": "qa", "messages": [{"role": "system", "content": "..."}, ...]}

or ShareGPT's JSON, an array of conversations:

    [{"id": "x1", "conversations": [{"from": "human", "value": "..."},
                                    {"from": "gpt", "value": "..."}]}, ...]

Each entry gives exactly one of `messages` (roles system, developer, user and
assistant, the last message the user's), `prompt` (a text prompt, sent as --chat
says, like --prompts-file's) or `conversations` (ShareGPT: the request is the
conversation up to and including its last human turn; one without a human turn is
skipped, as ShareGPT dumps hold some). `max_tokens`, where given, is that request's
output length instead of a draw from --output-len; ShareGPT's answers are not
measured for it (loadgen has no tokenizer, and words are not tokens). An optional
string `kind` is kept in the request's record; other keys (ShareGPT's `id`) are
ignored. Errors name the file and line (and, in an array, the entry).

Request i is entry order_e[i mod n] of the file's n requests, where e = i // n and
order_e is a permutation seeded by (--seed, e): shuffled passes over the file, so
every request is sent once per pass, and request i is the same at any rate or
number of requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.errors import UsageError
from loadgen.prompts import Conversation

FLAG = "--requests-file"
FILE_STREAM = 4  # the seed-sequence branch for the order of the file's requests
REQUEST_KEYS = ("messages", "prompt", "conversations")
ROLES = ("system", "developer", "user", "assistant")
MESSAGE_KEYS = frozenset({"role", "content"})
# ShareGPT's speakers (its dumps use more names than human and gpt) as chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant",
                  "system": "system"}
ORDER_CACHE = 4  # permutations kept: requests are taken roughly in index order
_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class FileRequest:
    prompt: str | Conversation
    max_tokens: int | None  # None: drawn from --output-len
    where: str  # file:line, for errors and the request's record
    kind: str | None = None


@dataclass(frozen=True)
class RequestFile:
    path: str
    requests: tuple[FileRequest, ...]
    skipped: int = 0  # ShareGPT conversations without a human turn
    _orders: dict[tuple[int, int], np.ndarray] = field(
        default_factory=dict, compare=False, repr=False
    )

    def pick(self, seed: int, index: int) -> FileRequest:
        """Request `index` of the run: shuffled passes over the file, seeded by `seed`."""
        epoch, slot = divmod(index, len(self.requests))
        order = self._orders.get((seed, epoch))
        if order is None:
            rng = np.random.default_rng([seed, FILE_STREAM, epoch])
            order = rng.permutation(len(self.requests))
            while len(self._orders) >= ORDER_CACHE:
                del self._orders[next(iter(self._orders))]
            self._orders[(seed, epoch)] = order
        return self.requests[int(order[slot])]

    def check_grpc(self) -> None:
        """gRPC's chat=true wraps one user message: refuse what it cannot carry."""
        for request in self.requests:
            prompt = request.prompt
            if isinstance(prompt, Conversation) and prompt.lone_user_text() is None:
                roles = ", ".join(role for role, _ in prompt.messages)
                raise UsageError(
                    f"{FLAG} {request.where}: a conversation of {len(prompt.messages)} "
                    f"messages ({roles}) cannot go over gRPC, whose chat request is one user "
                    "message: use --api openai (chat completions take the whole conversation)"
                )


def read_request_file(path: str) -> RequestFile:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{FLAG}: cannot read {path}: {error}") from None
    start = _WHITESPACE.match(text, 0)
    entries = _array(text, path) if start and text.startswith("[", start.end()) else _lines(
        text, path
    )
    requests, skipped = [], 0
    for item, where in entries:
        request = _request(item, where)
        if request is None:
            skipped += 1
        else:
            requests.append(request)
    if not requests:
        why = f" ({skipped} conversations without a human turn)" if skipped else ""
        raise UsageError(f"{FLAG}: {path} holds no requests{why}")
    return RequestFile(path, tuple(requests), skipped)


def _lines(text: str, path: str) -> Iterator[tuple[Any, str]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield json.loads(line), where
        except json.JSONDecodeError as error:
            raise UsageError(f"{FLAG} {where}: not JSON ({error.msg})") from None


def _array(text: str, path: str) -> Iterator[tuple[Any, str]]:
    """A JSON array's elements, each with the line it starts on."""
    decoder = json.JSONDecoder()
    position = _skip(text, text.index("[") + 1)
    line, counted = 1, 0  # the line number at offset `counted`
    entry = 0
    more = not text.startswith("]", position)  # an empty array has no first element
    while more:
        line += text.count("\n", counted, position)
        counted = position
        where = f"{path}:{line} (entry {entry})"
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise UsageError(f"{FLAG} {path}:{error.lineno}: not JSON ({error.msg})") from None
        yield item, where
        entry += 1
        position = _skip(text, position)
        more = text.startswith(",", position)
        if more:
            position = _skip(text, position + 1)
    if not text.startswith("]", position) or _skip(text, position + 1) != len(text):
        lineno = text.count("\n", 0, position) + 1
        raise UsageError(f"{FLAG} {path}:{lineno}: not JSON (expected ',' or one final ']')")


def _skip(text: str, position: int) -> int:
    match = _WHITESPACE.match(text, position)
    return match.end() if match else position


def _request(item: Any, where: str) -> FileRequest | None:
    if not isinstance(item, dict):
        raise UsageError(f"{FLAG} {where}: each request must be a JSON object")
    given = [key for key in REQUEST_KEYS if key in item]
    if len(given) != 1:
        raise UsageError(f"{FLAG} {where}: give exactly one of {', '.join(REQUEST_KEYS)}")
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise UsageError(f"{FLAG} {where}: max_tokens must be an integer >= 1")
    kind = item.get("kind")
    if kind is not None and not isinstance(kind, str):
        raise UsageError(f"{FLAG} {where}: kind must be a string")
    prompt: str | Conversation | None
    if given[0] == "prompt":
        prompt = item["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise UsageError(f"{FLAG} {where}: prompt must be a non-empty string")
    elif given[0] == "messages":
        prompt = _messages(item["messages"], where)
    else:
        prompt = _sharegpt(item["conversations"], where)
        if prompt is None:
            return None
    return FileRequest(prompt, max_tokens, where, kind)


def _messages(value: Any, where: str) -> Conversation:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{FLAG} {where}: messages must be a non-empty list")
    messages = []
    for i, message in enumerate(value):
        at = f"{FLAG} {where}: messages[{i}]"
        if not isinstance(message, dict):
            raise UsageError(f"{at} must be an object with role and content")
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise UsageError(f"{at} has unknown key(s) {', '.join(unknown)}; "
                             "a message is its role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise UsageError(f"{at}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise UsageError(f"{at}: content must be a string")
        messages.append((role, content))
    if messages[-1][0] != "user":
        raise UsageError(f"{FLAG} {where}: the last message must be the user's (the request "
                         f"asks for the answer to it), got {messages[-1][0]!r}")
    return Conversation(tuple(messages))


def _sharegpt(value: Any, where: str) -> Conversation | None:
    """The conversation up to and including its last human turn; None without one."""
    if not isinstance(value, list):
        raise UsageError(f"{FLAG} {where}: conversations must be a list of turns")
    turns = []
    for i, turn in enumerate(value):
        at = f"{FLAG} {where}: conversations[{i}]"
        if not isinstance(turn, dict):
            raise UsageError(f"{at} must be an object with from and value")
        speaker, text = turn.get("from"), turn.get("value")
        if speaker not in SHAREGPT_ROLES:
            raise UsageError(f"{at}: from must be one of {', '.join(SHAREGPT_ROLES)}, "
                             f"got {speaker!r}")
        if not isinstance(text, str):
            raise UsageError(f"{at}: value must be a string")
        turns.append((SHAREGPT_ROLES[speaker], text))
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is None:
        return None
    return Conversation(tuple(turns[: last_user + 1]))
