"""Gemma 3 270M's KV with and without a block table per layer group
(EngineConfig.hybrid_kv): the memory the sliding layers give back and what
the tables cost a step.

    python bench/hybrid_kv.py [--quick]

Gemma 3 270M (Q4_K_M GGUF, `specpage models fetch gemma3-270m`), loaded once
as `specpage serve` loads it, runs two engines in turn, hybrid_kv on and
off, speculation off: a batch of prompts longer than the sliding window
(random token ids, the same for both), greedy, a fixed number of tokens
each (ignore_eos). Both engines first run the same batch untimed; then the
rounds rotate the order (bench/common.py rotated). Per round: the median
decode step's time (steps after every sequence has its first token), the
prefill's time (until every sequence has its first token) and the peak KV
in blocks of every layer (a grouped pool's blocks in use over its number
of groups). Medians with min-max spreads; the greedy tokens of the two are
compared.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, compare, finish, machine, parse_args, rotated, rounds  # noqa: E402
from specpage.core.engine_config import EngineConfig  # noqa: E402
from specpage.core.layer_groups import GroupedPool  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine.engine import Engine  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.models.loader import load_model  # noqa: E402

# (sequences, prompt tokens, output tokens) by --quick; Gemma 3 270M's window is 512
SHAPE = {False: (4, 900, 48), True: (2, 600, 16)}


def run_batch(loaded: Any, hybrid: bool, prompts: list[list[int]], tokens: int,
              seen: dict[bool, dict[str, list[int]]], figures: dict[str, list[float]]) -> float:
    """One batch on a fresh engine; appends its figures, returns the median
    decode step in ms."""
    eng = Engine(loaded, None, None, EngineConfig(hybrid_kv=hybrid, spec_methods=""))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {}
    peak, steps = 0.0, []
    groups = len(eng.pool.groups.windows) if isinstance(eng.pool, GroupedPool) else 1
    start = time.perf_counter()
    prefill = 0.0
    while eng.has_unfinished():
        began = time.perf_counter()
        decoding = len(out) == len(prompts)
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        if decoding:
            steps.append(time.perf_counter() - began)
        elif len(out) == len(prompts):
            prefill = time.perf_counter() - start
        peak = max(peak, eng.pool.stats().in_use / groups)
    assert eng.pool.stats().in_use == 0
    seen.setdefault(hybrid, out)
    step_ms = statistics.median(steps) * 1e3
    figures["prefill_s"].append(prefill)
    figures["peak_blocks"].append(peak)
    return step_ms


def main() -> None:
    args = parse_args(__doc__)
    count = rounds(args.quick)
    sequences, prompt_tokens, tokens = SHAPE[args.quick]
    loaded = load_model(str(ensure_model("gemma3-270m")), quantization="auto")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (prompt_tokens,), generator=generator).tolist()
               for _ in range(sequences)]
    seen: dict[bool, dict[str, list[int]]] = {}
    figures = {hybrid: {"prefill_s": [], "peak_blocks": []} for hybrid in (True, False)}
    spreads = rotated({name: (lambda job, h=hybrid: run_batch(loaded, h, prompts, tokens, seen,
                                                              figures[h]))
                       for name, hybrid in (("hybrid", True), ("plain", False))},
                      None, None, count)
    result: dict[str, Any] = {"bench": "hybrid_kv", "model": "gemma3-270m Q4_K_M",
                              "sequences": sequences, "prompt_tokens": prompt_tokens,
                              "output_tokens": tokens, "rounds": count, "machine": machine()}
    for name, hybrid in (("hybrid", True), ("plain", False)):
        # the warm-up's figures are the first of each list: left out
        result[name] = {"decode_step_ms": spreads[name].as_json(),
                        **{key: Spread.of(values[1:]).as_json()
                           for key, values in figures[hybrid].items()}}
    result["headline"] = {
        "decode_step": compare(spreads["hybrid"], spreads["plain"], higher_is_better=False),
        "peak_blocks_hybrid_over_plain": (result["hybrid"]["peak_blocks"]["median"]
                                          / result["plain"]["peak_blocks"]["median"]),
        "same_tokens": seen[True] == seen[False]}
    finish("hybrid_kv", result)


if __name__ == "__main__":
    main()
