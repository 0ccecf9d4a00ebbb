"""The adaptive-k guard under load: throughput of 32 concurrent requests
(mixed output lengths, greedy, SmolLM2-135M-Instruct fp32) with speculation
off, with the default draft and adaptive k, and with a useless draft (the
draft's architecture with random weights) and adaptive k. Adaptive k must
never make the daemon more than 5% slower than speculation off, whatever the
draft; bench/speculation.py checks the same at one stream.

Single runs of this size vary by about ±10% on a shared 2-core machine, so
the three configurations run in turn, in rotated order, for several rounds,
and the medians count. Every ratio comes from this one run.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, parse_args  # noqa: E402
from bench.engine import specpage_throughput  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from bench.speculation import useless_draft  # noqa: E402
from specpage.engine import EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402


def main() -> None:
    args = parse_args(__doc__)
    if not (args.draft / "config.json").is_file():
        sys.exit(f"no draft at {args.draft}: train it with `python -m draft.train`")
    folder = ensure_model("smollm2-135m")
    count, (low, high), rounds = (8, (8, 24), 2) if args.quick else (32, (32, 128), 5)

    def config(spec_k: int) -> EngineConfig:
        return EngineConfig(num_blocks=2048, max_num_seqs=64, spec_k=spec_k, adaptive_k=True)

    with tempfile.TemporaryDirectory() as tmp:
        useless = useless_draft(args.draft, Path(tmp) / "useless")
        llms = {"off": LLM(folder, config=config(0)),
                "default_draft": LLM(folder, draft=args.draft, config=config(6)),
                "useless_draft": LLM(folder, draft=useless, config=config(6))}
    rng = random.Random(0)
    prompts = [chat_prompt(llms["off"].tokenizer, text) for text in chat_prompts(count)]
    lengths = [rng.randint(low, high) for _ in prompts]
    names = list(llms)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(specpage_throughput(llms[name], prompts, lengths))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in runs.items())
              + " tok/s", file=sys.stderr)
    median = {name: statistics.median(values) for name, values in runs.items()}
    stats = {name: llms[name].engine.stats() for name in names[1:]}
    total = rounds * (sum(lengths) + sum(lengths[:2]))  # timed runs and their warm-ups
    finish("adaptive", {
        "bench": "adaptive",
        "model": "SmolLM2-135M-Instruct fp32, greedy, adaptive k (k at most 6)",
        "requests": count,
        "output_tokens": sum(lengths),
        "rounds": rounds,
        "tok_s_median": median,
        "tok_s_runs": runs,
        "default_draft_vs_off": median["default_draft"] / median["off"],
        "useless_draft_vs_off": median["useless_draft"] / median["off"],
        "drafted_per_output_token": {name: s.drafted_tokens / total for name, s in stats.items()},
        "per_token_acceptance": {name: s.per_token_acceptance for name, s in stats.items()},
        "machine": machine(),
    })


if __name__ == "__main__":
    main()
