"""llama-cpp-python's OpenAI server, run by bench/llama_cpp.py inside
.venv-llama (it imports nothing of specpage's), with two changes for the
benchmarks' client, neither touching generation speed:
- every completion's end-of-sequence token is banned: the requests all ask
  for ``ignore_eos`` (vLLM's extension, which this server ignores), so that
  every system streams exactly max_tokens tokens;
- an X-Request-Id that is not a UUID is accepted (the server's middleware
  answers 400 to loadgen's ids, e.g. lg-fd38e7-0, otherwise);
- a streamed chat completion ends with a usage chunk, as vLLM's does for
  stream_options.include_usage: this server sends none, and ends with a
  chunk of its own that carries only the finish reason, which a client
  counting chunks would take for one more token. With the end-of-sequence
  token banned a completion stops only at max_tokens (finish reason
  "length"), so that is its token count; otherwise the content chunks are.
Arguments are the server's own."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import llama_cpp
import llama_cpp.server.app
from llama_cpp.server.__main__ import main
from starlette_context.plugins import RequestIdPlugin

BANNED = float("-inf")


def ban_eos(create: Any) -> Any:
    @functools.wraps(create)
    def create_completion(self: llama_cpp.Llama, *args: Any, **kwargs: Any) -> Any:
        kwargs["logit_bias"] = {**(kwargs.get("logit_bias") or {}), self.token_eos(): BANNED}
        return create(self, *args, **kwargs)

    return create_completion


def with_usage(create: Any) -> Any:
    @functools.wraps(create)
    def create_chat_completion(self: llama_cpp.Llama, *args: Any, **kwargs: Any) -> Any:
        result = create(self, *args, **kwargs)
        return _ending_with_usage(result, kwargs.get("max_tokens")) if kwargs.get(
            "stream") else result

    return create_chat_completion


def _ending_with_usage(chunks: Iterator[dict[str, Any]], max_tokens: int | None
                       ) -> Iterator[dict[str, Any]]:
    content, last, finish = 0, None, None
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            content += bool((choice.get("delta") or {}).get("content"))
            finish = choice.get("finish_reason") or finish
        last = chunk
        yield chunk
    if last is not None:
        tokens = max_tokens if finish == "length" and max_tokens else content
        yield {"id": last["id"], "object": last["object"], "created": last["created"],
               "model": last["model"], "choices": [],
               "usage": {"prompt_tokens": None, "completion_tokens": tokens,
                         "total_tokens": None}}


llama_cpp.Llama.create_completion = ban_eos(llama_cpp.Llama.create_completion)  # type: ignore[method-assign]
llama_cpp.Llama.create_chat_completion = with_usage(  # type: ignore[method-assign]
    llama_cpp.Llama.create_chat_completion)
llama_cpp.server.app.RequestIdPlugin = functools.partial(RequestIdPlugin, validate=False)

if __name__ == "__main__":
    main()
