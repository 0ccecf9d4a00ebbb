"""The Triton kernels on a GPU at serving sizes, in one run: achieved memory
traffic as a fraction of a large device-to-device copy's, side by side with
torch's scaled_dot_product_attention over a contiguous cache of the same
contents (the no-paging baseline).

Traffic counts the bytes a kernel must move at least (every K/V row of a
context read once per KV head, q read and the output written once), read and
written alike, as does the copy's (size read + size written). Times are
medians of triton.testing.do_bench. Decode targets >= 75% of the copy's
traffic and no slower than contiguous SDPA.

Defaults: 64 sequences x 2048 context, 32 query heads, 8 KV heads, head dim
128, bf16, block size 16, blocks scattered over the pool. Writes
results/kernels_gpu.json; the last line printed is the same JSON object.
Without CUDA it prints a `skipped` line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish  # noqa: E402

DECODE_TARGET = 0.75  # fraction of copy traffic


def skip(reason: str) -> None:
    print(json.dumps({"bench": "kernels_gpu", "skipped": reason}))


def time_ms(fn: Callable[[], object], quick: bool) -> float:
    import triton.testing

    warmup, rep = (5, 20) if quick else (25, 200)
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_traffic(quick: bool) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), quick)
    return 2 * src.numel() / (ms * 1e-3)


class Pool:
    """A paged cache of one layer, its sequences' blocks scattered, and the
    same contents laid out contiguously for SDPA."""

    def __init__(self, args: argparse.Namespace, spans: list[tuple[int, int]]) -> None:
        from specpage.attention.triton import TritonAttention
        from specpage.core.span import Span

        bs, kv_heads, d = args.block_size, args.kv_heads, args.head_dim
        context = spans[0][0] + spans[0][1]
        per_seq = -(-context // bs)
        num_blocks = per_seq * len(spans)
        order = torch.randperm(num_blocks).tolist()
        tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(len(spans))]
        self.meta = TritonAttention().build_metadata(
            [Span([1] * new, start, t) for (start, new), t in zip(spans, tables, strict=True)],
            bs,
            args.heads // kv_heads,
            torch.device("cuda"),
        )
        self.cache = torch.randn(
            2, num_blocks, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda"
        )  # [2, num_blocks, block_size, kv_heads, head_dim]
        blocks = self.cache[:, self.meta.block_tables]  # [2, seqs, blocks, bs, kv, d]
        # [num_seqs, kv_heads, context, head_dim]
        self.k = blocks[0].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        self.v = blocks[1].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        self.kv_bytes = self.k.nbytes + self.v.nbytes


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def fraction(nbytes: int, ms: float, copy: float) -> float:
    return round(nbytes / (ms * 1e-3) / copy, 3)


def bench_decode(args: argparse.Namespace, copy: float) -> dict[str, Any]:
    from specpage.kernels.triton.paged_decode import paged_decode

    pool = Pool(args, [(args.context - 1, 1)] * args.num_seqs)
    q = torch.randn(args.num_seqs, args.heads, args.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    ms = time_ms(lambda: paged_decode(q, pool.cache, pool.meta, scale, out), args.quick)
    # One query token attends to everything, so a KV head's query heads can
    # ride along the query axis: plain MHA-shaped SDPA, any backend.
    groups = args.heads // args.kv_heads
    q_rows = q.view(args.num_seqs, args.kv_heads, groups, args.head_dim)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_rows, pool.k, pool.v, scale=scale)

    sdpa_ms = time_ms(sdpa, args.quick)
    nbytes = pool.kv_bytes + q.nbytes + out.nbytes
    return {
        "ms": round(ms, 4),
        "fraction_of_copy": fraction(nbytes, ms, copy),
        "sdpa_ms": round(sdpa_ms, 4),
        "sdpa_fraction_of_copy": fraction(nbytes, sdpa_ms, copy),
        "speedup_vs_sdpa": round(sdpa_ms / ms, 3),
        "rel_error_vs_sdpa": rel_error(out, sdpa().reshape(out.shape)),
        "bytes": nbytes,
    }


def bench_spans(args: argparse.Namespace, copy: float, num_seqs: int, new: int) -> dict[str, Any]:
    from torch.nn.attention.bias import causal_lower_right

    from specpage.kernels.triton.paged_prefill import paged_prefill

    pool = Pool(args, [(args.context - new, new)] * num_seqs)
    q = torch.randn(num_seqs * new, args.heads, args.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    ms = time_ms(lambda: paged_prefill(q, pool.cache, pool.meta, scale, out), args.quick)
    nbytes = pool.kv_bytes + q.nbytes + out.nbytes
    flops = 4 * num_seqs * args.heads * args.head_dim * (new * args.context - new * (new - 1) / 2)
    result: dict[str, Any] = {
        "num_seqs": num_seqs,
        "new_tokens": new,
        "ms": round(ms, 4),
        "fraction_of_copy": fraction(nbytes, ms, copy),
        "tflops": round(flops / (ms * 1e-3) / 1e12, 2),
        "bytes": nbytes,
    }
    q_sdpa = q.view(num_seqs, new, args.heads, args.head_dim).transpose(1, 2)
    mask = causal_lower_right(new, args.context)  # span token i sees context - new + i

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_sdpa, pool.k, pool.v, attn_mask=mask, scale=scale, enable_gqa=True
        )

    try:
        sdpa_ms = time_ms(sdpa, args.quick)
    except (RuntimeError, TypeError, NotImplementedError) as error:
        result["sdpa_error"] = f"{type(error).__name__}: {error}"[:200]
        return result
    ref = sdpa().transpose(1, 2).reshape(out.shape)
    result.update(
        sdpa_ms=round(sdpa_ms, 4),
        sdpa_fraction_of_copy=fraction(nbytes, sdpa_ms, copy),
        speedup_vs_sdpa=round(sdpa_ms / ms, 3),
        rel_error_vs_sdpa=rel_error(out, ref),
    )
    return result


def bench_write_kv(args: argparse.Namespace, copy: float) -> dict[str, Any]:
    from specpage.kernels.triton.kv_write import write_kv

    num_tokens = args.num_seqs * 128  # e.g. one 128-token prefill chunk per sequence
    pool = Pool(args, [(args.context - 128, 128)] * args.num_seqs)
    shape = (num_tokens, args.kv_heads, args.head_dim)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    slots = pool.meta.slot_mapping
    ms = time_ms(lambda: write_kv(pool.cache, k, v, slots), args.quick)
    nbytes = 2 * (k.nbytes + v.nbytes) + slots.nbytes
    return {
        "tokens": num_tokens,
        "ms": round(ms, 4),
        "fraction_of_copy": fraction(nbytes, ms, copy),
    }


def bench_copy_blocks(args: argparse.Namespace, copy: float) -> dict[str, Any]:
    from specpage.kernels.triton.block_copy import copy_blocks

    layers, num_blocks, num_pairs = (8, 1024, 256) if args.quick else (32, 2048, 512)
    shape = (layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    blocks = torch.randperm(num_blocks, device="cuda")
    pairs = torch.stack([blocks[:num_pairs], blocks[num_pairs : 2 * num_pairs]], dim=1)
    ms = time_ms(lambda: copy_blocks(cache, pairs), args.quick)
    nbytes = 2 * num_pairs * cache[:, :, 0].nbytes
    return {
        "layers": layers,
        "pairs": num_pairs,
        "ms": round(ms, 4),
        "fraction_of_copy": fraction(nbytes, ms, copy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        skip("no CUDA device")
        return
    from specpage.kernels.triton import is_interpreted
    from specpage.kernels.triton.paged_decode import _paged_decode_kernel

    if is_interpreted(_paged_decode_kernel):
        skip("TRITON_INTERPRET is set")
        return
    if args.quick:
        args.num_seqs, args.context = min(args.num_seqs, 32), min(args.context, 1024)
    torch.manual_seed(0)
    copy = copy_traffic(args.quick)
    decode = bench_decode(args, copy)
    result = {
        "bench": "kernels_gpu",
        "device": torch.cuda.get_device_name(),
        "quick": args.quick,
        "shape": {
            "num_seqs": args.num_seqs,
            "context": args.context,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": "bfloat16",
        },
        "copy_traffic_gb_s": round(copy / 1e9, 1),
        "decode": decode,
        "decode_meets_target": decode["fraction_of_copy"] >= DECODE_TARGET
        and decode["speedup_vs_sdpa"] >= 1.0,
        "verify_k4": bench_spans(args, copy, args.num_seqs, 5),
        "prefill_chunk": bench_spans(args, copy, max(1, args.num_seqs // 8), 512),
        "write_kv": bench_write_kv(args, copy),
        "copy_blocks": bench_copy_blocks(args, copy),
    }
    finish("kernels_gpu", result)


if __name__ == "__main__":
    main()
