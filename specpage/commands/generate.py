"""`specpage generate`: run one prompt in-process and stream the text."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig
from specpage.llm import LLM, chat_prompt
from specpage.models.quant_names import QUANTIZATIONS


def add_parser(sub: Any, name: str) -> None:
    parser = sub.add_parser(name, help="generate text for one prompt", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--model", default="smollm2-135m", help="HF folder, .gguf or a known name")
    parser.add_argument("--draft", help="draft model (HF folder or .gguf); none: no speculation")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--spec-k", default="auto", help="proposals per step, or 'auto' (adaptive)")
    parser.add_argument("--raw", action="store_true",
                        help="send the prompt as it is (chat=False); by default it is wrapped in "
                             "the model's chat template as one user message (chat=True): "
                             "in-process only if the model has one, and a --server daemon "
                             "refuses a model without one")
    parser.add_argument("--dtype", help="fp32 (CPU default), bf16, fp16")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="weights of both models' linears: none (default, exact), q4 (int4, "
                             "a Q4_0/Q4_1 GGUF's own blocks or round-to-nearest), q4-g64, "
                             "q4-g128, auto (q4 where the model is a Q4 GGUF); q8 is refused. "
                             "A quantized model computes in bf16 unless --dtype says otherwise")
    parser.add_argument("--server", help="HOST:PORT of a running daemon (instead of in-process)")
    parser.add_argument("--token", help="bearer token for --server")
    parser.set_defaults(run=run)


def parse_spec_k(text: str) -> tuple[int, bool]:
    if text == "auto":
        return 4, True
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"--spec-k must be an integer >= 0 or 'auto', got {text!r}") from None
    if k < 0:
        raise ValueError(f"--spec-k must be >= 0, got {k}")
    return k, False


def run(args: argparse.Namespace) -> int:
    if args.server:
        if args.draft:
            # The daemon's draft is fixed at its start; a request cannot choose one.
            print("specpage generate: --draft is ignored with --server: the daemon runs "
                  "its own draft (specpage info shows which)", file=sys.stderr)
        return asyncio.run(run_remote(args))
    k, adaptive = parse_spec_k(args.spec_k)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    params.validate()
    config = EngineConfig(spec_k=k, adaptive_k=adaptive, num_blocks=512)
    llm = LLM(args.model, args.draft if k else None, config, dtype=args.dtype,
              quantization=args.quantization)
    prompt: str | list[int] = args.prompt
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompt = chat_prompt(llm.tokenizer, args.prompt)
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


async def run_remote(args: argparse.Namespace) -> int:
    from specpage.client import Chunk, Client

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                "top_p": args.top_p, "top_k": args.top_k}
    if args.seed is not None:
        sampling["seed"] = args.seed
    spec = "auto" if args.spec_k == "auto" else ("off" if args.spec_k == "0" else "on")
    async with Client(args.server, token=args.token) as client:
        async for event in client.generate(args.prompt, chat=not args.raw, spec=spec, **sampling):
            if isinstance(event, Chunk) and event.index == 0:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
