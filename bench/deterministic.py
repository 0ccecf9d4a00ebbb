"""What engine.deterministic costs, through the daemon: the same server
started with and without `--deterministic`, side by side.

    python bench/deterministic.py [--quick] [--dtypes q4,fp32]

Each dtype runs as `make serve` starts it (the target with the default draft,
adaptive k and the proposers that need no model) and with no draft; q4 is
the default (`--quantization auto`, the GGUF's own Q4_1 blocks), fp32 is
`--quantization none`. The workloads and the client are bench/serving.py's:
32 concurrent streams and a single stream of the benchmarks' chat prompts
through loadgen's OpenAI client, greedy, `max_tokens` with `ignore_eos`.
Rounds are rotated, one server up at a time, the same warm-up for each;
medians with min–max spreads, and the ratio deterministic / default of output
tokens per second (below 1: the mode costs that share) with "level" where
the spreads overlap. The greedy answers of both are compared too (the mode
changes a product's summation order, so a few may differ from the default's,
but never between runs of the deterministic server).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, parse_args, rounds  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from bench.serving import (  # noqa: E402
    OUTPUT_TOKENS,
    SINGLE_REQUESTS,
    STREAMS,
    WARMUP_SINGLE,
    WARMUP_TOKENS,
    ServerSpec,
    Workload,
    print_table,
    ratios,
    rotated_rounds,
    same_outputs,
    specpage_server,
    spreads,
)

QUANTIZATION = {"q4": "auto", "fp32": "none"}


def deterministic_server(name: str, draft: Path | None, threads: int, quantization: str,
                         ) -> ServerSpec:
    spec = specpage_server(name, draft, threads, quantization)
    return replace(spec, argv=[*spec.argv, "--deterministic"])


def options(parser: Any) -> None:
    parser.add_argument("--dtypes", default="q4",
                        help="comma-separated: q4 (the default) and fp32 (default: q4)")


def main() -> None:
    args = parse_args(__doc__, extra=options)
    started = time.perf_counter()
    tokens = OUTPUT_TOKENS[args.quick]
    prompts = chat_prompts(STREAMS)
    jobs = [Workload("streams32", prompts, tokens, STREAMS),
            Workload("single", prompts[:SINGLE_REQUESTS[args.quick]], tokens, 1)]
    warmups = [Workload("warmup32", prompts, WARMUP_TOKENS, STREAMS),
               Workload("warmup1", prompts[:WARMUP_SINGLE], WARMUP_TOKENS, 1)]
    pairs: dict[str, str] = {}  # deterministic system -> its default
    specs: dict[str, Callable[[], ServerSpec]] = {}
    drafts = {"": args.draft} if args.quick else {"": args.draft, "_no_draft": None}
    for dtype in args.dtypes.split(","):
        quantization = QUANTIZATION[dtype]
        for suffix, draft in drafts.items():
            name = f"{dtype}{suffix}"
            specs[name] = partial(specpage_server, name, draft, args.threads, quantization)
            specs[f"{name}_deterministic"] = partial(
                deterministic_server, f"{name}_deterministic", draft, args.threads, quantization)
            pairs[f"{name}_deterministic"] = name
    result: dict[str, Any] = {
        "bench": "deterministic", "client": "specpage-loadgen run --api openai (chat, streamed)",
        "model": "SmolLM2-135M-Instruct, greedy, ignore_eos", "output_tokens": tokens,
        "load_average_start": os.getloadavg()[0]}
    runs, errors = rotated_rounds(specs, jobs, warmups, rounds(args.quick))
    table = {name: {job.name: {metric: s.as_json() for metric, s in spreads(r, job.name).items()}
                    for job in jobs} for name, r in runs.items()}
    print_table(table)
    found = {det: base for det, base in pairs.items() if det in runs and base in runs}
    result.update(
        errors=errors, systems=table,
        deterministic_vs_default={
            det: {job.name: ratios(spreads(runs[det], job.name), spreads(runs[base], job.name))
                  for job in jobs} for det, base in found.items()},
        outputs_vs_default={det: same_outputs(runs[det], runs[base])
                            for det, base in found.items()},
        outputs_between_rounds={det: same_outputs(runs[det][-1:], runs[det][:1])
                                for det in found},
        load_average_end=os.getloadavg()[0], machine=machine(),
        wall_s=time.perf_counter() - started)
    finish("deterministic", result)


if __name__ == "__main__":
    main()
