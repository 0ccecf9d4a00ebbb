"""The adaptive-k guard under load: throughput of 32 concurrent requests
(mixed output lengths, greedy, SmolLM2-135M-Instruct fp32) with speculation
off, with the default draft and adaptive k, and with a useless draft (the
draft's architecture with random weights) and adaptive k; with --head HEAD,
also with that EAGLE-3 head and with a useless head (its layout and
configuration, random weights). Adaptive k must never make the daemon more
than 5% slower than speculation off, whatever the draft; bench/speculation.py
checks the same at one stream.

Single runs of this size vary by about ±10% on a shared 2-core machine, so
the three configurations run in turn, in rotated order, for several rounds
(bench/common.py), after the same untimed warm-up; medians and min–max
spreads count, and a ratio whose spreads overlap is "level". Every ratio
comes from this one run.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compare, finish, machine, parse_args, rotated, rounds  # noqa: E402
from bench.engine import Specpage, Workload  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from bench.speculation import useless_draft  # noqa: E402
from specpage.engine import EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

# Its ratios sit within a few percent of 1, so its full run takes more rounds.
ROUNDS = 5


def useless_head(head: Path, out: Path) -> Path:
    """The head's configuration and layout (its draft vocabulary kept) with
    random weights: proposals it makes are almost never accepted."""
    generator = torch.Generator().manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((head / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config))
    for source in head.glob("*.safetensors"):
        tensors = load_file(source)
        save_file({name: (torch.randn(t.shape, generator=generator).to(t.dtype) * 0.02
                          if t.is_floating_point() else t) for name, t in tensors.items()},
                  out / source.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (head / name).is_file():
            shutil.copy(head / name, out / name)
    return out


def main() -> None:
    args = parse_args(__doc__, extra=lambda parser: parser.add_argument(
        "--head", type=Path, default=None, help="an EAGLE-3 head: adds it and a useless head"))
    if not (args.draft / "config.json").is_file():
        sys.exit(f"no draft at {args.draft}: train it with `python -m draft.train`")
    folder = ensure_model("smollm2-135m")
    count, (low, high) = (8, (8, 24)) if args.quick else (32, (32, 128))

    def config(spec_k: int) -> EngineConfig:
        return EngineConfig(num_blocks=2048, max_num_seqs=64, spec_k=spec_k, adaptive_k=True)

    with tempfile.TemporaryDirectory() as tmp:
        useless = useless_draft(args.draft, Path(tmp) / "useless")
        systems = {"off": Specpage(LLM(folder, config=config(0))),
                   "default_draft": Specpage(LLM(folder, draft=args.draft, config=config(6))),
                   "useless_draft": Specpage(LLM(folder, draft=useless, config=config(6)))}
        if args.head is not None:
            useless = useless_head(args.head, Path(tmp) / "useless_head")
            systems["head"] = Specpage(LLM(folder, draft=args.head, config=config(6)))
            systems["useless_head"] = Specpage(LLM(folder, draft=useless, config=config(6)))
    drafts = [name for name in systems if name != "off"]
    rng = random.Random(0)
    prompts = [chat_prompt(systems["off"].llm.tokenizer, text) for text in chat_prompts(count)]
    job = Workload(prompts, [rng.randint(low, high) for _ in prompts])
    count_rounds = rounds(args.quick, full=ROUNDS)
    spreads = rotated(systems, job, job, count_rounds)
    stats = {name: systems[name].llm.engine.stats() for name in drafts}
    total = (count_rounds + 1) * job.tokens  # the timed runs and the warm-up
    finish("adaptive", {
        "bench": "adaptive",
        "model": "SmolLM2-135M-Instruct fp32, greedy, adaptive k (k at most 6)",
        "requests": count,
        "output_tokens": job.tokens,
        "rounds": count_rounds,
        "tok_s": {name: spread.as_json() for name, spread in spreads.items()},
        **{f"{name}_vs_off": compare(spreads[name], spreads["off"]) for name in drafts},
        "drafted_per_output_token": {name: s.drafted_tokens / total for name, s in stats.items()},
        "per_token_acceptance": {name: s.per_token_acceptance for name, s in stats.items()},
        # greedy outputs of each system's last run against speculation off's
        # (the same tokens but where a CPU sum's order flips a near-tie)
        "same_outputs_as_off": {name: sum(a == b for a, b in zip(systems[name].outputs,
                                                                  systems["off"].outputs,
                                                                  strict=True))
                                for name in drafts},
        "machine": machine(),
    })


if __name__ == "__main__":
    main()
