"""What the proposers that need no model would gain on the target's own
greedy answers, replayed without the engine: an upper reference for
bench/model_free.py, which measures the same requests through the daemon.

    python bench/model_free_replay.py [--quick]

1. The target as `make serve` loads it (q4, no draft) answers every request
   of bench/workloads/grounded.jsonl and chat.jsonl greedily, speculation
   off, all of a set in one batch. The target's cost curve (seconds against
   positions verified) is timed as one stream verifies: n positions of one
   sequence after a chat-sized context, the least of three measurements.
   (The daemon's start-up measurement times n positions as n decode rows,
   each reading its own context, which costs more; its policy corrects
   those prices from the forwards it runs. Both curves are in the result.)
2. Each answer is replayed step by step through specpage's own
   ModelFreeProposer (prompt lookup and the suffix cache, the chances it
   learns by evidence): each step the proposal is cut to the length that
   promises the most tokens per second at the curve's prices (the policy's
   rule for one stream, core/policy.py), the tokens the target would accept
   are those that equal its answer, and the step costs the curve's price of
   1 + length positions. Requests of a set run one after another, so the
   suffix cache holds the earlier ones' outputs, as in the daemon bench.

Speed-up = tokens over the replay's seconds against one token per plain
step, by kind. Also "oracle": each step proposes exactly the tokens the
target will accept of the better of the two methods' candidates (the most a
length rule could make of these proposals), and "no suffix": prompt lookup
alone. The scheduler, sampling and the daemon cost nothing here, so the
daemon's figures fall below these by its overheads.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL, finish, machine, parse_args  # noqa: E402
from bench.model_free import QUICK_REQUESTS, QUICK_TOKENS, load, render  # noqa: E402
from specpage.core.engine_config import EngineConfig  # noqa: E402
from specpage.core.model_free import Method, ModelFreeProposer, Speculation  # noqa: E402
from specpage.core.policy import CostCurve, _best_length  # noqa: E402
from specpage.core.request import FinishReason, Request, SamplingParams, Sequence  # noqa: E402
from specpage.engine.builder import ModelChoice, build_engine  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.speculation.calibrate import Plan, fit_segments, measure  # noqa: E402

Answers = dict[str, list[list[int]]]
ROUNDS = 3  # measurements of one sequence's verify costs; the least of each size counts


def answers(sets: dict[str, list[dict[str, Any]]]) -> tuple[Answers, dict[str, list[float]]]:
    """Each request's greedy answer, by set, and the target's prices of a
    step verifying 1 .. k + 1 positions: of one sequence (what a single
    stream verifies) and as the start-up measurement times them (as rows)."""
    config = EngineConfig()
    engine, _ = build_engine(ModelChoice(ensure_model(MODEL), None, None, "cpu", "auto"), config)
    out: Answers = {}
    for name, requests in sets.items():
        submitted = []
        for i, r in enumerate(requests):
            request = engine.make_request(f"{name}-{i}", r["ids"], SamplingParams(
                max_tokens=r["max_tokens"], temperature=0.0))
            request.spec_k = 0
            engine.submit(request)
            submitted.append(request)
        while engine.has_unfinished():
            engine.step()
        out[name] = [list(r.sequences[0].output_token_ids) for r in submitted]
    # what the daemon prices at start-up (or an earlier start cached): n
    # positions as n decode rows, each after its own context; a busy moment
    # can leave it short of sizes, so it is tried again
    rows = engine.core.policy.target_cost
    for _ in range(3):
        measured = engine.executor.measure_costs(config, engine.max_context).target
        if len(measured) >= 2:
            rows = CostCurve(fit_segments(list(measured)))
            break
    # what one stream's verify costs: n positions of one sequence, the least
    # of ROUNDS measurements of each size at different moments
    sizes = list(range(1, config.model_free_k + 2))
    plan = Plan.make(sizes, 1, config.num_blocks, engine.max_context)
    least: dict[int, float] = {}
    for _ in range(ROUNDS):
        for n, seconds in measure([(engine.executor.target, True)], plan)[0].items():
            least[n] = min(least.get(n, math.inf), seconds)
    one = CostCurve(fit_segments(sorted(least.items())))
    return out, {"one_sequence": [one(n) for n in sizes], "rows": [rows(n) for n in sizes]}


def replay(requests: list[dict[str, Any]], outputs: list[list[int]], seconds: list[float],
           methods: str, oracle: bool = False) -> dict[str, list[float]]:
    """{kind: [tokens, seconds, steps]} over the requests, one after another."""
    config = EngineConfig(spec_methods=methods)
    proposer = ModelFreeProposer(config)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for i, (r, answer) in enumerate(zip(requests, outputs, strict=True)):
        request = Request(f"r{i}", tuple(r["ids"]), SamplingParams(
            max_tokens=len(answer), temperature=0.0))
        seq = Sequence(i, request, 0, list(r["ids"]))
        request.sequences.append(seq)
        done = 0
        while done < len(answer):
            length = min(config.model_free_k, len(answer) - done - 1)
            found = proposer.propose(seq, length) if length > 0 else None
            k = 0
            if found is not None:
                right = next((j for j, t in enumerate(found.tokens) if t != answer[done + j]),
                             len(found.tokens))
                k = right if oracle else _best_length(found.chance, seconds)[0]
                k = k if not oracle or (k + 1) / seconds[k] > 1 / seconds[0] else 0
            accepted = 0
            if k:
                assert found is not None
                accepted = next((j for j in range(k) if found.tokens[j] != answer[done + j]), k)
                proposer.observe(seq, Speculation(k, tuple(found.tokens[:k]), found.method,
                                                  sum(found.chance[:k]),
                                                  tuple(found.evidence[:k])), accepted)
            seq.token_ids += answer[done: done + accepted + 1]
            done += accepted + 1
            figures = by_kind[r["kind"]]
            figures[1] += seconds[k]
            figures[2] += 1
        by_kind[r["kind"]][0] += len(answer)
        proposer.end(seq, FinishReason.STOP)
    return by_kind


def speedups(by_kind: dict[str, list[float]], seconds: list[float]) -> dict[str, Any]:
    total = [sum(v[i] for v in by_kind.values()) for i in range(3)]
    kinds = {kind: v[0] / v[1] * seconds[0] for kind, v in sorted(by_kind.items())}
    return {"speedup": total[0] / total[1] * seconds[0], "tokens_per_step": total[0] / total[2],
            "by_kind": kinds}


def main() -> None:
    args = parse_args(__doc__)
    cap = QUICK_TOKENS if args.quick else None
    sets = {name: render(load(name), cap) for name in ("grounded", "chat")}
    if args.quick:
        sets = {name: requests[:QUICK_REQUESTS] for name, requests in sets.items()}
    outputs, prices = answers(sets)
    seconds = prices["one_sequence"]
    results: dict[str, Any] = {}
    for name, requests in sets.items():
        results[name] = {
            "specpage": speedups(replay(requests, outputs[name], seconds, "ngram,suffix"),
                                 seconds),
            "no_suffix": speedups(replay(requests, outputs[name], seconds, "ngram"), seconds),
            "oracle": speedups(replay(requests, outputs[name], seconds, "ngram,suffix",
                                      oracle=True), seconds),
        }
    finish("model_free_replay", {
        "machine": machine(), "verify_seconds": seconds,
        "verify_over_decode": [s / seconds[0] for s in seconds],
        "rows_over_decode": [s / prices["rows"][0] for s in prices["rows"]], "sets": results,
        "headline": {f"{name}/{rule}": r["speedup"] for name, rules in results.items()
                     for rule, r in rules.items()},
        "methods": [m.value for m in Method]})


if __name__ == "__main__":
    main()
