"""Where the pool puts a sequence's blocks, and what it does to a step: the
pool's placement (core/block_pool.py: a sequence goes on into the block
after its last, and starts in the middle of the longest free run) against
taking free blocks in the order they were freed (a FIFO free list, as the
pool did before), in one process, alternated round by round.

    python bench/block_placement.py [--quick] [--streams 32] [--spec off|auto]

The target as `make serve` loads it (q4), no draft, greedy, every request's
max_tokens decoded (ignore_eos). The requests are the first `--streams` of
bench/workloads' grounded and chat prompts, all at once. Each run starts
from an empty pool (a daemon's first requests; once every block has been
used, both take cached blocks least recently freed first, the same way).
The figure is the seconds of the steps in which every sequence decodes
(no prompt computed), summed; the outputs of the two must be the same.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL, Spread, compare, finish, machine, parse_args, rounds  # noqa: E402
from specpage.core.block_pool import BlockPool  # noqa: E402
from specpage.core.engine_config import EngineConfig  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine.builder import ModelChoice, build_engine  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"
PLACED = BlockPool._allocate


def freed_order(pool: BlockPool, after: int | None) -> int:
    """BlockPool._allocate as it was: the free block freed longest ago,
    wherever the table's last block is."""
    if not pool._num_free:
        return PLACED(pool, None)  # a cached block, evicted as by the pool
    block = pool._oldest_free()
    pool._is_free[block] = 0
    pool._num_free -= 1
    pool._refcount[block] = 1
    return block


def prompts(count: int) -> list[list[int]]:
    """The first `count` workload prompts, through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_model(MODEL))
    lines = []
    for name in ("grounded", "chat"):
        text = (WORKLOADS / f"{name}.jsonl").read_text()
        lines += [json.loads(line) for line in text.splitlines() if line.strip()]
    rendered = []
    for request in lines[:count]:
        ids = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True)
        rendered.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return rendered


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--streams", type=int, default=32)
        p.add_argument("--spec", choices=("off", "auto"), default="off")

    args = parse_args(__doc__, extra=extra)
    max_tokens = 48 if args.quick else 150
    engine, _ = build_engine(ModelChoice(ensure_model(MODEL), None, None, "cpu", "auto"),
                                  EngineConfig(max_num_seqs=max(64, args.streams)))
    pool = engine.core.pool
    assert isinstance(pool, BlockPool), type(pool)
    requests = prompts(args.streams)
    outputs: dict[str, list[list[int]]] = {}

    def run(policy: str, name: str) -> float:
        BlockPool._allocate = PLACED if policy == "placed" else freed_order  # type: ignore[method-assign,assignment]
        pool.__init__(pool.num_blocks, pool.block_size, pool.model_identity)  # type: ignore[misc]
        made = []
        for i, ids in enumerate(requests):
            request = engine.make_request(f"{name}-{i}", ids, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            request.spec_k = 0 if args.spec == "off" else None
            engine.submit(request)
            made.append(request)
        seconds = 0.0
        scheduler = engine.scheduler
        while engine.has_unfinished():
            decoding = not scheduler.num_waiting and all(
                s.num_computed >= s.num_prompt for s in scheduler.running)
            start = time.perf_counter()
            engine.step()
            if decoding:
                seconds += time.perf_counter() - start
        outputs[policy] = [r.sequences[0].output_token_ids for r in made]
        return seconds

    run("placed", "warm")
    figures: dict[str, list[float]] = {"placed": [], "freed_order": []}
    for r in range(rounds(args.quick, 4)):
        order = ["placed", "freed_order"] if r % 2 == 0 else ["freed_order", "placed"]
        for policy in order:
            figures[policy].append(run(policy, f"r{r}-{policy}"))
            print(f"round {r}: {policy} {figures[policy][-1]:.2f} s", file=sys.stderr, flush=True)
    BlockPool._allocate = PLACED  # type: ignore[method-assign]
    placed, fifo = Spread.of(figures["placed"]), Spread.of(figures["freed_order"])
    finish("block_placement", {
        "machine": machine(), "streams": args.streams, "spec": args.spec,
        "max_tokens": max_tokens,
        "placed_seconds": placed.as_json(), "freed_order_seconds": fifo.as_json(),
        "placed_vs_freed_order": compare(placed, fifo, higher_is_better=False),
        "same_outputs": outputs["placed"] == outputs["freed_order"],
    })


if __name__ == "__main__":
    main()
