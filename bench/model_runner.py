"""The paged model runner against HF transformers on SmolLM2-135M fp32, same
inputs, one run: prefill tokens/s and decode step time at batch 1, 8 and 32,
with the memory-bandwidth floor of a batch-1 decode step, and one sequence
verifying 5 positions (k = 4) against its batch-1 decode step. Each case runs both
in rotated order over several rounds after the same warm-up call
(bench/common.py); a round's figure is the median of a few calls, and a
speed-up whose spreads overlap is "level".

The floor: a decode step must read every weight once, so it takes at least
weight bytes / read bandwidth, with the read bandwidth taken as the memory
traffic of a large copy (bytes read + written per second). Beside it, the
time to read the weights at the rate a large buffer is read (reading
alone): on some machines the copy's traffic is well above that rate. This
machine's memory rate moves by up to 2x within minutes, so both rates are
measured in the same rotated rounds as the step, and the step over its floor
is taken round by round (median, min-max).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    compare,
    finish,
    machine,
    median_seconds,
    memory_rates,
    over_floor,
    rotated,
    rounds,
)
from specpage.core.span import Span  # noqa: E402
from specpage.executor.model_runner import ModelRunner  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.models.loader import load_model  # noqa: E402

BLOCK_SIZE = 16
CALLS = 3  # calls per round; a round's figure is their median
ROUNDS = 5  # rounds of a full run: its cases take milliseconds each
VERIFY_SPAN = 5  # a verify step of k = 4 proposals


def per_call(fn: Callable[[], object]) -> Callable[[None], float]:
    """A system for bench.common.rotated: the median seconds of CALLS calls."""
    return lambda _: median_seconds(fn, repeats=CALLS, warmup=0)


def ours_vs_hf(ours: Callable[[], object], hf: Callable[[], object],
               quick: bool) -> dict[str, Any]:
    spreads = rotated({"ours": per_call(ours), "hf": per_call(hf)}, None, None,
                      rounds(quick, full=ROUNDS))
    return {"ours_s": spreads["ours"].median, "hf_s": spreads["hf"].median,
            "ours": spreads["ours"].as_json(), "hf": spreads["hf"].as_json(),
            **compare(spreads["ours"], spreads["hf"], higher_is_better=False)}


def ours_decode(runner: ModelRunner, batch: int, context: int) -> Callable[[], object]:
    blocks = -(-(context + 1) // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(context)] for i in range(batch)]
    runner.forward([Span(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    spans = [Span([5], context, t, 1) for t in tables]
    return lambda: runner.forward(spans)


def ours_verify(runner: ModelRunner, span: int, context: int) -> Callable[[], object]:
    """One sequence verifying `span` positions (k = span - 1 proposals), logits for each."""
    blocks = -(-(context + span) // BLOCK_SIZE)
    table = list(range(blocks))
    runner.forward([Span([(3 * j) % 40000 + 100 for j in range(context)], 0, table, 1)])
    spans = [Span([5] * span, context, table, span)]
    return lambda: runner.forward(spans)


def hf_decode(hf: torch.nn.Module, batch: int, context: int) -> Callable[[], object]:
    ids = torch.tensor([[(7 * i + j) % 40000 + 100 for j in range(context)] for i in range(batch)])
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    step = torch.full((batch, 1), 5)

    def one_step() -> None:
        with torch.inference_mode():
            hf(step, cache=cache, use_cache=True)
        cache.crop(-1)  # the same context length on every repeat

    return one_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="fp32",
                        help="specpage's dtype (fp32, bf16, auto); HF stays fp32")
    parser.add_argument("--batches", default=None, help="decode batches, e.g. 1,32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    folder = ensure_model("smollm2-135m")
    loaded = load_model(folder, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    context = 128 if args.quick else 256
    batches = (1, 8) if args.quick else (1, 8, 32)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    num_blocks = max(batches) * (-(-(context + 1) // BLOCK_SIZE)) + 8
    runner = ModelRunner(loaded, num_blocks, BLOCK_SIZE)

    prefill_len, prefill_batch = (128, 2) if args.quick else (256, 4)
    prompts = [[(11 * i + j) % 40000 + 100 for j in range(prefill_len)]
               for i in range(prefill_batch)]
    blocks = -(-prefill_len // BLOCK_SIZE)
    spans = [Span(p, 0, list(range(i * blocks, (i + 1) * blocks)), 1)
             for i, p in enumerate(prompts)]
    ids = torch.tensor(prompts)

    def hf_prefill_call() -> None:
        with torch.inference_mode():
            hf(ids, use_cache=True)

    prefill = ours_vs_hf(lambda: runner.forward(spans), hf_prefill_call, args.quick)
    ours_prefill, hf_prefill = prefill["ours_s"], prefill["hf_s"]
    tokens = prefill_len * prefill_batch

    rows = []
    for batch in batches:
        case = ours_vs_hf(ours_decode(runner, batch, context), hf_decode(hf, batch, context),
                          args.quick)
        ours, theirs = case["ours_s"], case["hf_s"]
        rows.append({"batch": batch, "ours_ms": ours * 1e3, "hf_ms": theirs * 1e3,
                     "speedup": case["ratio"], "verdict": case["verdict"],
                     "ours_s": case["ours"], "hf_s": case["hf"]})
        print(f"decode batch {batch:>2}: ours {ours * 1e3:7.2f} ms, HF {theirs * 1e3:7.2f} ms, "
              f"{case['ratio']:.2f}x ({case['verdict']})", file=sys.stderr)

    # Verifying k + 1 = 5 positions of one sequence against decoding one token,
    # and the batch-1 step against its floor, the memory rates measured in the
    # same rounds (bench.common.memory_rates).
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    verify = rotated({"verify_5": per_call(ours_verify(runner, VERIFY_SPAN, context)),
                      "decode_1": per_call(ours_decode(runner, 1, context)),
                      **memory_rates()}, None, None, rounds(args.quick, full=ROUNDS))
    verify_ratio = verify["verify_5"].median / verify["decode_1"].median
    print(f"verify {VERIFY_SPAN} positions: {verify['verify_5'].median * 1e3:.2f} ms, "
          f"{verify_ratio:.2f}x a batch-1 decode step", file=sys.stderr)
    floor = over_floor(verify["decode_1"], weight_bytes, verify["copy_traffic_gb_s"])
    read = over_floor(verify["decode_1"], weight_bytes, verify["read_alone_gb_s"])
    result = {
        "bench": "model_runner",
        "model": f"SmolLM2-135M-Instruct {loaded.model.embed_tokens.weight.dtype}",
        "prefill": {"tokens": tokens, "ours_tok_s": tokens / ours_prefill,
                    "hf_tok_s": tokens / hf_prefill, "speedup": prefill["ratio"],
                    "verdict": prefill["verdict"], "ours_s": prefill["ours"],
                    "hf_s": prefill["hf"]},
        "rounds": rounds(args.quick, full=ROUNDS),
        "decode_context": context,
        "decode": rows,
        "weight_mb": weight_bytes / 1e6,
        "batch1_ms": verify["decode_1"].median * 1e3,
        "copy_bandwidth_gb_s": floor["rate_gb_s"] / 2,
        "batch1_floor_ms": floor["floor_ms"],
        "batch1_over_floor": floor["ratio"]["median"],
        "batch1_over_floor_rounds": floor["ratio"],
        "read_bandwidth_gb_s": read["rate_gb_s"],
        "batch1_read_ms": read["floor_ms"],
        "batch1_over_read": read["ratio"]["median"],
        "batch1_over_read_rounds": read["ratio"],
        "verify": {"span": VERIFY_SPAN, "ours_s": verify["verify_5"].as_json(),
                   "decode_1_s": verify["decode_1"].as_json(), "over_decode_1": verify_ratio},
        "machine": machine(),
    }
    print(f"prefill: ours {tokens / ours_prefill:.0f} tok/s, HF {tokens / hf_prefill:.0f} tok/s; "
          f"batch-1 step {verify['decode_1'].median * 1e3:.2f} ms, {floor['ratio']['median']:.2f}x "
          f"its floor {floor['floor_ms']:.2f} ms ({floor['rate_gb_s'] / 2:.1f} GB/s copy) "
          f"({floor['ratio']['min']:.2f}-{floor['ratio']['max']:.2f} by round); weights read "
          f"alone {read['floor_ms']:.2f} ms ({read['rate_gb_s']:.1f} GB/s)", file=sys.stderr)
    finish("model_runner", result)


if __name__ == "__main__":
    main()
