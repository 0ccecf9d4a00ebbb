"""What the engine's own bookkeeping costs at batch 64: scheduler and block
pool time per step as a share of the step, on the real SmolLM2-135M-Instruct
fp32 run. 64 chat requests are admitted together and decode to a fixed
length; the steps counted are those where all 64 decode.

Timed parts of a step: the scheduler (admission, spans, block reservation,
copy-on-write), the pool's commit and rollback after verification, output
emission (detokenizing, stop checks), and the model forwards (draft
proposals and the target's verification). Two runs: speculation off, and the
default draft at a fixed k = 4 (the most pool work: k tentative slots per
sequence reserved and rolled back every step).

A third run decodes long outputs (1,024 tokens each; 192 with --quick),
speculation off: output emission (core/outputs.py: detokenizing and stop
checks for every sequence of the step) is timed on its own, over the whole
run and over its last quarter, where the outputs are longest. Emission that
decoded each whole output every step grew with the output's length there.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import decoding_steps, finish, machine, parse_args, time_part  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine import Engine, EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

BATCH = 64


def instrument(engine: Engine, spent: dict[str, float]) -> None:
    """Wrap the step's parts so that each adds its seconds to spent[part]."""

    def timed(owner: Any, name: str, part: str) -> None:
        time_part(owner, name, part, spent)

    # the core's two sides of the step: the schedule into a batch, and
    # applying the result (commit, rollback, outputs); then the models
    timed(engine.core, "schedule", "core_schedule")
    timed(engine.core, "apply", "core_apply")
    timed(engine.core.outputs, "append", "output_emission")
    if engine.executor.proposer is not None:
        timed(engine.executor.proposer, "propose", "draft_forwards")
    timed(engine.executor.verifier, "verify", "target_forward")


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    engine = llm.engine
    spent: dict[str, float] = defaultdict(float)
    instrument(engine, spent)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    shares: dict[str, list[float]] = defaultdict(list)
    steps = 0
    for total in decoding_steps(engine, BATCH, spent):
        steps += 1
        shares["step_ms"].append(total * 1e3)
        for part, seconds in spent.items():
            shares[part].append(seconds / total)
        shares["scheduler_and_pool"].append(
            (spent["core_schedule"] + spent["core_apply"]) / total)
        shares["output_emission_ms"].append(spent["output_emission"] * 1e3)
    engine.pool.check_integrity()
    late = steps * 3 // 4  # the last quarter of the steps: the longest outputs
    return {"decode_steps": steps,
            **{f"{part}_share" if not part.endswith("_ms") else part: statistics.median(v)
               for part, v in shares.items()},
            **{f"last_quarter_{part}": statistics.median(shares[part][late:])
               for part in ("step_ms", "output_emission_ms", "output_emission")}}


def main() -> None:
    args = parse_args(__doc__)
    target = ensure_model("smollm2-135m")
    tokens = 12 if args.quick else 48
    config = {"num_blocks": 2048, "max_num_seqs": BATCH, "max_step_tokens": 2048}
    plain = LLM(target, config=EngineConfig(spec_k=0, **config))
    prompts = [chat_prompt(plain.tokenizer, t) for t in chat_prompts(BATCH)]
    result: dict[str, Any] = {"bench": "overhead", "batch": BATCH, "tokens_each": tokens,
                              "spec_off": run(plain, prompts, tokens)}
    del plain
    if (args.draft / "config.json").is_file():
        spec = LLM(target, draft=args.draft,
                   config=EngineConfig(spec_k=4, adaptive_k=False, **config))
        result["spec_k4"] = run(spec, prompts, tokens)
    long = 192 if args.quick else 1024
    plain = LLM(target, config=EngineConfig(spec_k=0, **{**config, "num_blocks": 6144}))
    result["long_outputs"] = {"tokens_each": long, **run(plain, prompts, long)}
    result["machine"] = machine()
    finish("overhead", result)


if __name__ == "__main__":
    main()
