"""llama-cpp-python's OpenAI server, run by bench/llama_cpp.py inside
.venv-llama (it imports nothing of specpage's), with every completion's
end-of-sequence token banned: the benchmarks' requests all ask for
``ignore_eos`` (vLLM's extension, which this server ignores), so that every
system streams exactly max_tokens tokens. Arguments are the server's own."""

from __future__ import annotations

import functools
from typing import Any

import llama_cpp
from llama_cpp.server.__main__ import main

BANNED = float("-inf")


def ban_eos(create: Any) -> Any:
    @functools.wraps(create)
    def create_completion(self: llama_cpp.Llama, *args: Any, **kwargs: Any) -> Any:
        kwargs["logit_bias"] = {**(kwargs.get("logit_bias") or {}), self.token_eos(): BANNED}
        return create(self, *args, **kwargs)

    return create_completion


llama_cpp.Llama.create_completion = ban_eos(llama_cpp.Llama.create_completion)  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
