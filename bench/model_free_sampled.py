"""What the proposers that need no model can give a sampled request, and
what a better choice of proposal length could add: the engine in process,
the same requests as bench/model_free.py, single stream, at a temperature.

    python bench/model_free_sampled.py [--quick] [--temperature 0.7]

A sampled request accepts a proposed token x with the target's probability
p(x) (the proposal has no distribution of its own), so a proposal's worth
is known exactly once the target has scored it: the expected tokens of a
step that proposes x1..xL are 1 + p1 + p1 p2 + ... (each p given the tokens
before it, which is what verification computes). Three runs of every
request, each alone, in rotated order, each with its own cache_salt:

- off: speculation off;
- auto: the engine's policy, as `make serve` runs it;
- whole: every model-free candidate proposed whole (up to
  engine.spec_model_free_k tokens), so that its every token's p is seen.

Per set: auto's decode speed against off (tokens over the seconds of the
steps that decode), its tokens per step and step time against off's; the
steps' times by proposal length, against off's median step; and from the
whole run's proposals, the most a length rule could make of them (the
"oracle cut": each step cut to the length that maximizes the run's expected
tokens per second at those measured times), beside the policy's own
expected figure on its run. The oracle cut's ratio is a ceiling for any
length rule over these proposals on this machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL, finish, machine, parse_args  # noqa: E402
from bench.model_free import QUICK_REQUESTS, QUICK_TOKENS, load, render  # noqa: E402
from specpage.core.engine_config import EngineConfig  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine.builder import ModelChoice, build_engine  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.speculation import verifier  # noqa: E402

MODES = ("off", "auto", "whole")
Step = tuple[int, list[float], float]  # (tokens, p of each token proposed, seconds)


class Recorder:
    """The proposed tokens' probabilities of each verification (single
    stream: one sequence a step), taken where the verifier decides."""

    def __init__(self) -> None:
        self.last: list[float] = []
        decide = verifier._decide

        def recorded(rows: Any, works: Any, ks: list[int], proposal: Any,
                     p_at: list[float]) -> Any:
            self.last = list(p_at[: ks[0]]) if ks else []
            return decide(rows, works, ks, proposal, p_at)

        verifier._decide = recorded


def run(engine: Any, recorder: Recorder, request: dict[str, Any], mode: str,
        temperature: float, index: int, k: int) -> list[Step]:
    submitted = engine.make_request(f"{mode}-{index}", request["ids"], SamplingParams(
        max_tokens=request["max_tokens"], temperature=temperature))
    submitted.cache_salt = mode.encode()
    submitted.spec_k = {"off": 0, "auto": None, "whole": k}[mode]
    engine.submit(submitted)
    steps: list[Step] = []
    while engine.has_unfinished():
        before = len(submitted.sequences[0].output_token_ids) if submitted.sequences else 0
        recorder.last = []
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        made = len(submitted.sequences[0].output_token_ids) - before
        if before and made:  # a decoding step (the first token comes with the prompt)
            steps.append((made, recorder.last, seconds))
    return steps


def expected(p: list[float], length: int) -> float:
    """Expected tokens of a step proposing the first `length` of these."""
    tokens = chain = 1.0
    for x in p[:length]:
        chain *= x
        tokens += chain
    return tokens


def oracle_cut(steps: list[Step], cost: list[float]) -> float:
    """Expected tokens per unit of cost with each step cut to the length
    that maximizes the run's ratio (Dinkelbach's iteration)."""
    rate = 1.0 / cost[0]
    for _ in range(50):
        tokens = spent = 0.0
        for _, p, _ in steps:
            best = max(range(len(p) + 1), key=lambda n: expected(p, n) - rate * cost[n])
            tokens += expected(p, best)
            spent += cost[best]
        if abs(tokens / spent - rate) < 1e-12:
            break
        rate = tokens / spent
    return rate


def figures(runs: dict[str, list[Step]], k: int) -> dict[str, Any]:
    off, auto, whole = runs["off"], runs["auto"], runs["whole"]
    off_step = statistics.median(s for _, _, s in off)
    by_length: dict[int, list[float]] = defaultdict(list)
    for _, p, seconds in auto + whole:
        by_length[len(p)].append(seconds / off_step)
    # each length's median step against off's, made non-decreasing (a
    # length seldom run borrows the next shorter's time)
    cost, floor = [], 1.0
    for n in range(k + 1):
        floor = max(floor, statistics.median(by_length[n]) if by_length[n] else floor)
        cost.append(floor)

    def speed(steps: list[Step]) -> float:
        return sum(t for t, _, _ in steps) / sum(s for _, _, s in steps)

    return {
        "auto_vs_off": speed(auto) / speed(off),
        "auto_tokens_per_step": sum(t for t, _, _ in auto) / len(auto),
        "auto_step_vs_off": statistics.mean(s for _, _, s in auto) / statistics.mean(
            s for _, _, s in off),
        "step_vs_off_by_length": {n: [len(by_length[n]), c] for n, c in enumerate(cost)},
        "policy_expected": sum(expected(p, len(p)) for _, p, _ in auto)
        / sum(cost[len(p)] for _, p, _ in auto),
        "oracle_cut": oracle_cut(whole, cost),
        "whole_uncut": sum(expected(p, len(p)) for _, p, _ in whole)
        / sum(cost[len(p)] for _, p, _ in whole),
        "off_step_ms": off_step * 1e3,
        "tokens": {mode: sum(t for t, _, _ in runs[mode]) for mode in MODES},
    }


def main() -> None:
    p = parse_args(__doc__, extra=lambda a: a.add_argument(
        "--temperature", type=float, default=0.7, help="above 0 (sampled, unseeded)"))
    if p.temperature <= 0:
        raise SystemExit("--temperature must be above 0: a greedy request's proposals "
                         "have no probabilities to price")
    config = EngineConfig()
    engine, _ = build_engine(ModelChoice(ensure_model(MODEL), None, None, "cpu", "auto"), config)
    recorder = Recorder()
    k = config.model_free_k
    result: dict[str, Any] = {"machine": machine(), "temperature": p.temperature}
    for name in ("grounded", "chat"):
        requests = render(load(name), QUICK_TOKENS if p.quick else None)
        if p.quick:
            requests = requests[:QUICK_REQUESTS]
        runs: dict[str, list[Step]] = {mode: [] for mode in MODES}
        for i, request in enumerate(requests):
            for j in range(len(MODES)):
                mode = MODES[(i + j) % len(MODES)]
                runs[mode] += run(engine, recorder, request, mode, p.temperature, i, k)
        result[name] = figures(runs, k)
    engine.pool.check_integrity()
    finish("model_free_sampled", result)


if __name__ == "__main__":
    main()
