"""What the proposers that need no model cost the step: their matching and
index upkeep (prompt lookup's n-gram counts brought up to date, the suffix
cache's lookups, a finished text counted in and evicted ones counted out)
and the policy's choice, as a share of the step, at 32 streams with
2,000-token contexts.

    python bench/model_free_cost.py [--quick]

In process, the target as `make serve` loads it (q4), no draft. Every
sequence's prompt is a shared passage of real text (the grounded workload's
prompts, bench/workloads/grounded.jsonl) and a question of its own, so the
prefix cache spares most of the prefill; the proposers index every
sequence's whole context all the same (they count what each sequence holds,
not what the pool computed). The wrapped calls are timed with the step they
run in: ModelFreeProposer.propose (lookup and upkeep), .index (a step's
committed tokens counted in, prompts by the steps that compute them) and
.end (the suffix cache's insert and evictions), SpecPolicy.speculate (the
choice), and Engine.step (the whole step). Half of the requests finish before the other
half starts, so the second half runs against a suffix cache that holds the
first's texts. The figures are shares of the decoding steps' time (steps
in which no prompt is computed), and of every step's (prefill included,
where a prompt is counted in); a share does not depend on how fast the
machine is as a time would.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL, finish, machine, parse_args  # noqa: E402
from specpage.core.engine_config import EngineConfig  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine.builder import ModelChoice, build_engine  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"


class Timed:
    """Wraps a bound method and adds up the seconds spent in it."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def passage(tokenizer: Any, tokens: int) -> list[int]:
    """About `tokens` tokens of the grounded workload's texts, one after another."""
    ids: list[int] = []
    for line in (WORKLOADS / "grounded.jsonl").read_text().splitlines():
        for message in json.loads(line)["messages"]:
            ids += tokenizer.encode(message["content"] + "\n", add_special_tokens=False)
            if len(ids) >= tokens:
                return ids[:tokens]
    return ids


def main() -> None:
    args = parse_args(__doc__)
    streams, context, decode = (8, 1000, 16) if args.quick else (32, 2000, 64)
    config = EngineConfig(max_num_seqs=max(64, streams))
    engine, models = build_engine(ModelChoice(ensure_model(MODEL), None, None, "cpu", "auto"),
                                  config)
    tokenizer = models.tokenizer
    shared = passage(tokenizer, context - 40)
    core = engine.core
    propose = core.model_free.propose = Timed(core.model_free.propose)
    end = core.model_free.end = Timed(core.model_free.end)
    speculate = core.policy.speculate = Timed(core.policy.speculate)
    index = core.model_free.index = Timed(core.model_free.index)
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)

    def prompt(i: int) -> list[int]:
        question = f"\nQuestion {i}: repeat sentence {i % 7 + 1} of the passage, word by word."
        return shared + tokenizer.encode(question, add_special_tokens=False)

    engine.add_request("warm", prompt(0), SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    scheduler = core.scheduler
    timed = (propose, end, speculate, index)
    spent = [0.0, 0.0, 0.0, 0.0]  # in decoding steps: propose, end, speculate, index
    step_seconds = all_seconds = 0.0
    steps = 0
    at_start = [t.seconds for t in timed]
    for half in range(2):
        for i in range(streams // 2 * half, streams // 2 * (half + 1)):
            engine.add_request(f"r{i}", prompt(i), params)
        while engine.has_unfinished():
            # a decoding step: nothing waits, every sequence has its prompt computed
            decoding = not scheduler.num_waiting and all(
                seq.num_computed >= seq.num_prompt for seq in scheduler.running)
            before = [t.seconds for t in timed]
            start = time.perf_counter()
            engine.step()
            all_seconds += time.perf_counter() - start
            if decoding:
                step_seconds += time.perf_counter() - start
                steps += 1
                for j, t in enumerate(timed):
                    spent[j] += t.seconds - before[j]
    stats = engine.stats()
    upkeep = spent[0] + spent[1] + spent[3]
    in_all = [t.seconds - first for t, first in zip(timed, at_start, strict=True)]
    result = {
        "machine": machine(), "streams": streams, "context_tokens": len(prompt(0)),
        "decode_tokens": decode, "decoding_steps": steps, "step_seconds": step_seconds,
        "matching_and_upkeep_share": upkeep / step_seconds,
        "propose_share": spent[0] / step_seconds, "end_share": spent[1] / step_seconds,
        "policy_share": spent[2] / step_seconds, "index_share": spent[3] / step_seconds,
        # every step, the prompts' prefill included: where prompts are counted in
        "all_steps_seconds": all_seconds,
        "all_steps_upkeep_share": (in_all[0] + in_all[1] + in_all[3]) / all_seconds,
        "all_steps_index_share": in_all[3] / all_seconds,
        "counts_made": core.model_free.num_counted,
        "suffix_cache_tokens": stats.suffix_cache_tokens,
        "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
    }
    finish("model_free_cost", result)


if __name__ == "__main__":
    main()
