"""Cost of the pool's side of one speculative step, per sequence.

256 running sequences, k = 4: each step reserves k + 1 tentative slots per
sequence, commits a random accepted count plus one, and rolls back the rest.
A sequence that reaches --max-len is freed and replaced by a new prompt that
shares a system prefix, as under continuous batching. Prints the headline
figures as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

from specpage.core.block_pool import BlockPool

TARGET_US = 10.0


def run(num_seqs: int, k: int, steps: int, block_size: int, max_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    per_seq_blocks = -(-(max_len + k + 1) // block_size) + 1
    pool = BlockPool(num_seqs * per_seq_blocks + 64, block_size, model_identity=b"bench")
    system = [rng.randrange(49152) for _ in range(48)]

    def new_prompt() -> list[int]:
        return system + [rng.randrange(49152) for _ in range(rng.randrange(1, 80))]

    ids = list(range(num_seqs))
    next_id = num_seqs
    for seq in ids:
        prompt = new_prompt()
        cached = pool.allocate_prompt(seq, prompt)
        pool.commit(seq, prompt[cached:])
    # Accepted counts and tokens drawn up front so the timing is the pool's.
    accepted = [[rng.randint(0, k) for _ in range(num_seqs)] for _ in range(steps)]
    tokens = [rng.randrange(49152) for _ in range(k + 1)]

    start = time.perf_counter()
    for step in range(steps):
        counts = accepted[step]
        for i, seq in enumerate(ids):
            pool.reserve(seq, k + 1)
            pool.commit(seq, tokens[: counts[i] + 1])
            pool.rollback(seq)
            if pool.num_committed(seq) >= max_len:
                pool.free(seq)
                prompt = new_prompt()
                cached = pool.allocate_prompt(next_id, prompt)
                pool.commit(next_id, prompt[cached:])
                ids[i] = next_id
                next_id += 1
    elapsed = time.perf_counter() - start
    pool.check_integrity()
    us = elapsed / (steps * num_seqs) * 1e6
    return {
        "bench": "block_pool",
        "us_per_seq_step": round(us, 3),
        "target_us": TARGET_US,
        "meets_target": us < TARGET_US,
        "num_seqs": num_seqs,
        "k": k,
        "steps": steps,
        "block_size": block_size,
        "sequences_replaced": next_id - num_seqs,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run (seconds)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    steps = 200 if args.quick else 2000
    result = run(args.num_seqs, args.k, steps, args.block_size, args.max_len, args.seed)
    result["quick"] = args.quick
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "block_pool.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['us_per_seq_step']:.2f} µs per sequence per step "
          f"(target < {TARGET_US} µs), {result['sequences_replaced']} sequences replaced",
          file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
