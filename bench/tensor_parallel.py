"""Tensor parallelism on SmolLM2-135M-Instruct (9 heads, 3 KV heads): 1 and
3 ranks (gloo, one machine). Aggregate output tokens/s for a batch of
concurrent greedy requests (target alone, so the figure is the split
forward's), and the seconds rank 0 spends per step in all-reduces and the
logits' gather (waiting for slower ranks included): the communication cost.

On a 2-core machine 3 ranks share 2 cores (one torch thread each, against 2
for 1 rank), so they are not faster here; the figure shows what a step pays
to split. Each round builds the engine afresh (one process group per
process), warms it up with the same job untimed, then times it; sizes run in
rotated order, and every size's tokens are compared with 1 rank's.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, finish, machine, parse_args, rounds  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine import Engine, EngineConfig  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.models.loader import load_model  # noqa: E402

SIZES = (1, 3)  # ranks; SmolLM2-135M's heads divide by 3, not by 2
REQUESTS = 4
PROMPT_TOKENS = (24, 40, 56, 72)


def job(quick: bool) -> tuple[list[list[int]], SamplingParams]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS[i % 4])]
               for i in range(REQUESTS)]
    return prompts, SamplingParams(max_tokens=24 if quick else 64, temperature=0.0,
                                   ignore_eos=True)


def run_once(size: int, quick: bool) -> dict[str, Any]:
    prompts, params = job(quick)
    engine = Engine(load_model(ensure_model("smollm2-135m")), None, None,
                    EngineConfig(num_blocks=256, spec_k=0, tensor_parallel_size=size))
    try:
        def drain() -> tuple[dict[str, list[int]], int, float]:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{len(engine.requests)}-{i}", prompt, params)
            tokens: dict[str, list[int]] = {}
            steps, start = 0, time.perf_counter()
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id[-1]] = tokens.get(out.request_id[-1], []) + out.token_ids
                steps += 1
            return tokens, steps, time.perf_counter() - start

        drain()  # warm-up, untimed
        collectives = getattr(engine.executor, "collectives", None)
        before = collectives.seconds if collectives else 0.0
        tokens, steps, seconds = drain()
        communication = (collectives.seconds - before) if collectives else 0.0
    finally:
        engine.close()
    generated = sum(len(t) for t in tokens.values())
    return {"tok_s": generated / seconds, "steps": steps,
            "comm_ms_per_step": 1000 * communication / steps, "tokens": tokens}


def main() -> None:
    args = parse_args(__doc__)
    figures: dict[int, list[dict[str, Any]]] = {size: [] for size in SIZES}
    for r in range(rounds(args.quick)):
        order = SIZES[r % len(SIZES):] + SIZES[:r % len(SIZES)]
        for size in order:
            figures[size].append(run_once(size, args.quick))
            print(f"round {r}: {size} ranks {figures[size][-1]['tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    reference = figures[1][0]["tokens"]
    result: dict[str, Any] = {"machine": machine(), "model": "smollm2-135m",
                              "requests": REQUESTS, "max_tokens": job(args.quick)[1].max_tokens,
                              "sizes": {}}
    for size, runs in figures.items():
        result["sizes"][str(size)] = {
            "tok_s": Spread.of([f["tok_s"] for f in runs]).as_json(),
            "comm_ms_per_step": Spread.of([f["comm_ms_per_step"] for f in runs]).as_json(),
            "steps": runs[0]["steps"],
            "same_tokens_as_1": all(f["tokens"] == reference for f in runs),
        }
    finish("tensor_parallel", result)


if __name__ == "__main__":
    main()
