"""llama-cpp-python's OpenAI server, run by bench/llama_cpp.py inside
.venv-llama (it imports nothing of specpage's), with two changes for the
benchmarks' client, neither touching generation speed:
- every completion's end-of-sequence token is banned: the requests all ask
  for ``ignore_eos`` (vLLM's extension, which this server ignores), so that
  every system streams exactly max_tokens tokens;
- an X-Request-Id that is not a UUID is accepted (the server's middleware
  answers 400 to loadgen's ids, e.g. lg-fd38e7-0, otherwise).
Arguments are the server's own."""

from __future__ import annotations

import functools
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


llama_cpp.Llama.create_completion = ban_eos(llama_cpp.Llama.create_completion)  # type: ignore[method-assign]
llama_cpp.server.app.RequestIdPlugin = functools.partial(RequestIdPlugin, validate=False)

if __name__ == "__main__":
    main()
