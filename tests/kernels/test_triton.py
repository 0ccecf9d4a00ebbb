"""The Triton kernels against their pure-torch `*_ref` twins, the launchers'
argument checks, and TritonAttention against TorchAttention.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; with
CUDA (and TRITON_INTERPRET unset) the same small cases run compiled, and the
`gpu` tests repeat them at serving sizes.

Every case draws fresh inputs from a generator seeded by its test id, and
every output and unused cache slot starts as NaN, so a missed write or a read
outside a sequence's context shows.

Errors are max |ours - ref| / max |ref|, per dtype: both sides accumulate in
fp32 and round once to the storage dtype, so they differ by fp32 summation
order (~1e-7, long contexts a little more: fp32 bound 1e-5) plus, where the two
fp32 results straddle a rounding boundary, one ulp of the storage dtype: up to
2**-10 ~ 1e-3 for fp16 (11-bit significand; bound 2e-3) and 2**-7 ~ 8e-3 for
bf16 (8 bits; bound 2e-2). The interpreter rounds fp32 to bf16 by truncation,
so bf16 sees that ulp often (measured ~6e-3). On a GPU the fp16/bf16 kernels
also round the softmax weights to the storage dtype for the tensor-core P.V
dot (2**-11 / 2**-8 relative per weight, averaging out over the context),
which the same bounds absorb.
"""

import math
import os
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

# Triton reads TRITON_INTERPRET when it decorates a kernel, its own library
# functions (tl.zeros, tl.max, ...) included, so the mode must be set before
# triton is first imported. Without CUDA only the interpreter can run kernels.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import triton
import triton.language as tl

from specpage.attention.reference import TorchAttention, TorchMetadata
from specpage.attention.triton import TritonAttention, TritonMetadata
from specpage.core.span import Span
from specpage.kernels.triton import is_interpreted
from specpage.kernels.triton import paged_decode as paged_decode_module
from specpage.kernels.triton.block_copy import copy_blocks, copy_blocks_ref
from specpage.kernels.triton.kv_write import write_kv, write_kv_ref
from specpage.kernels.triton.paged_decode import (
    DecodeConfig,
    paged_decode,
    paged_decode_ref,
)
from specpage.kernels.triton.paged_prefill import paged_prefill, paged_prefill_ref

INTERPRET = bool(triton.knobs.runtime.interpret)
# In a whole-suite run another module may import triton first (transformers
# does, through torch._dynamo); its kernels are then fixed in the other mode.
DECORATED_IN_OTHER_MODE = any(
    is_interpreted(kernel) != INTERPRET
    for kernel in (tl.zeros, paged_decode_module._paged_spans_kernel)
)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [
    pytest.mark.skipif(
        DECORATED_IN_OTHER_MODE,
        reason="triton was imported before this module could set TRITON_INTERPRET; "
        "run with TRITON_INTERPRET=1, or set it in tests/conftest.py",
    ),
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(),
        reason="TRITON_INTERPRET=0 needs a CUDA device",
    ),
]
needs_gpu = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(),
    reason="needs CUDA and compiled kernels (TRITON_INTERPRET unset)",
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


# MHA, GQA (a non-power-of-two group too) and MQA with a group past 16 rows;
# head dims 64 and 128; block sizes 8, 16, 32; the three dtypes.
SHAPES = [
    pytest.param(Shape(4, 4, 64, 8, torch.float32), id="mha-d64-b8-fp32"),
    pytest.param(Shape(8, 2, 128, 16, torch.float16), id="gqa4-d128-b16-fp16"),
    pytest.param(Shape(8, 2, 64, 32, torch.bfloat16), id="gqa4-d64-b32-bf16"),
    pytest.param(Shape(6, 2, 128, 8, torch.bfloat16), id="gqa3-d128-b8-bf16"),
    pytest.param(Shape(2, 2, 128, 32, torch.float16), id="mha-d128-b32-fp16"),
    pytest.param(Shape(32, 1, 64, 16, torch.float32), id="mqa32-d64-b16-fp32"),
]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh inputs per case, reproducible from the test id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(rng: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=rng).to(dtype=dtype, device=DEVICE)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert not ours.isnan().any(), "NaN in the output: a row was not written or read poison"
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@dataclass(frozen=True)
class Batch:
    cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim], NaN off-context
    meta: TritonMetadata
    q: torch.Tensor  # [num_tokens, heads, head_dim]
    spans: list[Span]  # for another backend's metadata


def paged_batch(
    rng: torch.Generator, shape: Shape, spans: list[tuple[int, int]], spare_blocks: int = 3
) -> Batch:
    """spans: (start, num_new) per sequence. Blocks are scattered over the
    pool; every slot outside some sequence's context holds NaN."""
    bs = shape.block_size
    needed = [math.ceil((start + new) / bs) for start, new in spans]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=rng).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(order[used : used + count])
        used += count
    table_spans = [Span([1] * new, start, table)
                   for (start, new), table in zip(spans, tables, strict=True)]
    meta = TritonAttention().build_metadata(table_spans, bs, shape.groups, DEVICE)
    cache = torch.full(
        (2, num_blocks, bs, shape.kv_heads, shape.head_dim),
        float("nan"),
        dtype=shape.dtype,
        device=DEVICE,
    )
    flat = cache.view(2, -1, shape.kv_heads, shape.head_dim)
    for (start, new), table in zip(spans, tables, strict=True):
        positions = torch.arange(start + new)
        slots = torch.tensor(table)[positions // bs] * bs + positions % bs
        flat[:, slots.to(DEVICE)] = randn(
            rng, 2, len(slots), shape.kv_heads, shape.head_dim, dtype=shape.dtype
        )
    num_tokens = sum(new for _, new in spans)
    q = randn(rng, num_tokens, shape.heads, shape.head_dim, dtype=shape.dtype)
    return Batch(cache, meta, q, table_spans)


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


# -- kv_write ---------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_write_kv_matches_ref(rng: torch.Generator, shape: Shape) -> None:
    batch = paged_batch(rng, shape, [(5, 9), (0, 1), (20, 5)])
    num_tokens = batch.q.shape[0]
    kv_size = shape.kv_heads * shape.head_dim
    # K and V as the decoder hands them over: strided views into one projection.
    qkv = randn(rng, num_tokens, 3 * kv_size, dtype=shape.dtype)
    k = qkv[:, kv_size : 2 * kv_size].view(num_tokens, shape.kv_heads, shape.head_dim)
    v = qkv[:, 2 * kv_size :].view(num_tokens, shape.kv_heads, shape.head_dim)
    slots = batch.meta.slot_mapping.clone()
    ours = batch.cache
    ours.view(2, -1, shape.kv_heads, shape.head_dim)[:, slots] = float("nan")
    slots[3] = -1  # a padding token: skipped, its slot stays NaN
    ref = ours.clone()
    write_kv(ours, k, v, slots)
    write_kv_ref(ref, k, v, slots)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


# -- paged_decode -----------------------------------------------------------


@pytest.mark.parametrize("partition_size", [None, 32], ids=["whole", "split32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_decode_matches_ref(
    rng: torch.Generator, shape: Shape, partition_size: int | None
) -> None:
    # Context 1 leaves later partitions empty; 75 spans three of 32.
    batch = paged_batch(rng, shape, [(39, 1), (0, 1), (74, 1), (16, 1)])
    scale = shape.head_dim**-0.5
    out = paged_decode(
        batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q), partition_size,
        DecodeConfig(tile=32),
    )
    ref = paged_decode_ref(batch.q, batch.cache, batch.meta, scale)
    assert rel_error(out, ref) <= TOLERANCE[shape.dtype]


@pytest.mark.parametrize(
    ("partition_size", "config"),
    [(None, DecodeConfig()), (32, DecodeConfig(tile=32)), (16, DecodeConfig(tile=16)),
     (128, DecodeConfig(tile=128, num_warps=8, num_stages=2))],
    ids=["whole", "split32", "split16", "split128-tile128"],
)
@pytest.mark.parametrize("shape", SHAPES[:5])
def test_paged_decode_takes_verification_spans(
    rng: torch.Generator, shape: Shape, partition_size: int | None, config: DecodeConfig
) -> None:
    """Spans of 1 to 5 tokens in one launch, causal inside each. With
    partitions of 16 or 32, a span's early tokens see nothing of the last
    partition (position 64 alone is the last token's), which must weigh 0."""
    batch = paged_batch(rng, shape, [(60, 5), (0, 3), (30, 1), (11, 4), (0, 1)])
    assert paged_decode_module.takes_spans(batch.meta.max_query, shape.groups)
    scale = shape.head_dim**-0.5
    out = paged_decode(
        batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q), partition_size, config
    )
    ref = paged_prefill_ref(batch.q, batch.cache, batch.meta, scale)
    assert rel_error(out, ref) <= TOLERANCE[shape.dtype]


# -- paged_prefill ----------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_prefill_matches_ref(rng: torch.Generator, shape: Shape) -> None:
    # A fresh prompt, a chunk after earlier context, k + 1 = 5 verification
    # positions, and a single token, in one launch.
    batch = paged_batch(rng, shape, [(0, 19), (21, 13), (40, 5), (7, 1)])
    scale = shape.head_dim**-0.5
    out = paged_prefill(batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q))
    ref = paged_prefill_ref(batch.q, batch.cache, batch.meta, scale)
    assert rel_error(out, ref) <= TOLERANCE[shape.dtype]


# -- block_copy -------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_copy_blocks_matches_ref(rng: torch.Generator, shape: Shape) -> None:
    layers, num_blocks = 3, 10
    block = (shape.block_size, shape.kv_heads, shape.head_dim)
    cache = randn(rng, layers, 2, num_blocks, *block, dtype=shape.dtype)
    pairs = torch.tensor([[1, 7], [4, 2], [1, 9]], device=DEVICE)
    cache[:, :, pairs[:, 1]] = float("nan")  # a skipped copy leaves NaN behind
    ref = cache.clone()
    copy_blocks(cache, pairs)
    copy_blocks_ref(ref, pairs)
    torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=False)


# -- 64-bit offsets ---------------------------------------------------------


def test_offsets_past_int32(rng: torch.Generator) -> None:
    """Blocks whose element offsets pass 2**31, in K and in V. The cache is
    8 GiB of untouched memory; only the blocks in use get pages."""
    bs, kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (bs * kv_heads * head_dim) + 16
    try:
        cache = torch.empty(
            2, num_blocks, bs, kv_heads, head_dim, dtype=torch.float16, device=DEVICE
        )
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve 8 GiB of address space here")
    table = [5, num_blocks - 3, num_blocks - 1]
    meta_all = TritonAttention().build_metadata([Span([1] * 40, 0, table)], bs, 4, DEVICE)
    k = randn(rng, 40, kv_heads, head_dim, dtype=torch.float16)
    v = randn(rng, 40, kv_heads, head_dim, dtype=torch.float16)
    write_kv(cache, k, v, meta_all.slot_mapping)
    assert torch.equal(cache[1, num_blocks - 1, :8, 0], v[32:, 0])

    meta = TritonAttention().build_metadata([Span([1] * 5, 35, table)], bs, 4, DEVICE)
    q = randn(rng, 5, 4, head_dim, dtype=torch.float16)
    out = paged_prefill(q, cache, meta, 0.125, poisoned_like(q))
    assert rel_error(out, paged_prefill_ref(q, cache, meta, 0.125)) <= 2e-3
    decode_meta = TritonAttention().build_metadata([Span([1], 39, table)], bs, 4, DEVICE)
    out = paged_decode(q[:1], cache, decode_meta, 0.125, poisoned_like(q[:1]))
    assert rel_error(out, paged_decode_ref(q[:1], cache, decode_meta, 0.125)) <= 2e-3

    copy_blocks(cache[None], torch.tensor([[num_blocks - 1, 7], [5, num_blocks - 2]]).to(DEVICE))
    assert torch.equal(cache[:, 7], cache[:, num_blocks - 1])
    assert torch.equal(cache[:, num_blocks - 2], cache[:, 5])


# -- TritonAttention end to end ---------------------------------------------


def torch_metadata(batch: Batch, shape: Shape) -> TorchMetadata:
    """The reference backend's metadata for the batch's spans."""
    return TorchAttention().build_metadata(batch.spans, shape.block_size, shape.groups, DEVICE)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]])
def test_triton_attention_matches_torch_attention(rng: torch.Generator, shape: Shape) -> None:
    """A decode span, a prefill chunk after earlier context and a 5-token
    verification span: write K/V, then attend, through both backends."""
    batch = paged_batch(rng, shape, [(30, 1), (16, 20), (9, 5)])
    meta, num_tokens, scale = batch.meta, batch.q.shape[0], shape.head_dim**-0.5
    ref_meta = torch_metadata(batch, shape)
    k = randn(rng, num_tokens, shape.kv_heads, shape.head_dim, dtype=shape.dtype)
    v = randn(rng, num_tokens, shape.kv_heads, shape.head_dim, dtype=shape.dtype)
    # TorchAttention's SDPA reads every padded position, so no NaN poison here.
    cache = batch.cache.nan_to_num()
    ref_cache = cache.clone()
    TritonAttention().write_kv(cache, k, v, meta)
    TorchAttention().write_kv(ref_cache, k, v, ref_meta)
    assert torch.equal(cache, ref_cache)
    out = TritonAttention().attend(batch.q, cache, meta, scale)
    ref = TorchAttention().attend(batch.q, ref_cache, ref_meta, scale)
    assert out.shape == (num_tokens, shape.heads * shape.head_dim)
    assert rel_error(out, ref) <= TOLERANCE[shape.dtype]

    decode = paged_batch(rng, shape, [(30, 1), (3, 1)])
    decode_cache = decode.cache.nan_to_num()
    out = TritonAttention().attend(decode.q, decode_cache, decode.meta, scale)
    ref = TorchAttention().attend(decode.q, decode_cache, torch_metadata(decode, shape), scale)
    assert rel_error(out, ref) <= TOLERANCE[shape.dtype]


# -- launcher argument checks -----------------------------------------------


def small_batch() -> Batch:
    return paged_batch(
        torch.Generator().manual_seed(0), Shape(4, 2, 64, 16, torch.float32), [(3, 1), (9, 1)]
    )


def test_write_kv_rejects_bad_arguments() -> None:
    batch = small_batch()
    cache, slots = batch.cache, batch.meta.slot_mapping
    k = torch.zeros(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="k must be float32, got float16"):
        write_kv(cache, k.half(), k, slots)
    with pytest.raises(ValueError, match=r"v must be \[num_tokens, kv_heads, head_dim\]"):
        write_kv(cache, k, k[:, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64, got int32"):
        write_kv(cache, k, k, slots.int())
    with pytest.raises(ValueError, match="unit stride along head_dim"):
        write_kv(cache, k, k.transpose(1, 2).contiguous().transpose(1, 2), slots)
    with pytest.raises(ValueError, match=r"cache dim 0 must be 2 \(K, V\), got 1"):
        write_kv(cache[:1], k, k, slots)


def test_attention_launchers_reject_bad_arguments() -> None:
    batch = small_batch()
    q, cache, meta = batch.q, batch.cache, batch.meta
    with pytest.raises(ValueError, match="q must be float32, got bfloat16"):
        paged_decode(q.bfloat16(), cache, meta, 1.0)
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple"):
        paged_prefill(q[:, :3], cache, meta, 1.0)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16, got 48"):
        paged_decode(q[..., :48], cache[..., :48], meta, 1.0)
    with pytest.raises(ValueError, match=r"1 to max_query \(1\) tokens per sequence: got 1 "):
        paged_decode(q[:1], cache, meta, 1.0)
    with pytest.raises(ValueError, match=r"partition_size must be a positive multiple of the "
                       r"tile \(128\), got 48"):
        paged_decode(q, cache, meta, 1.0, partition_size=48)
    with pytest.raises(ValueError, match="tile must be a power of two >= 16, got 24"):
        paged_decode(q, cache, meta, 1.0, config=DecodeConfig(tile=24))
    with pytest.raises(ValueError, match="spans of at most 32 tokens with 2 query heads"):
        paged_decode(q, cache, replace(meta, max_query=33), 1.0)
    with pytest.raises(ValueError, match="block_tables must be int64, got int32"):
        paged_prefill(q, cache, replace(meta, block_tables=meta.block_tables.int()), 1.0)
    with pytest.raises(ValueError, match=r"query_start must have num_seqs \+ 1 = 3 entries"):
        paged_prefill(q, cache, replace(meta, query_start=meta.query_start[:2]), 1.0)
    with pytest.raises(ValueError, match="out must be float32"):
        paged_prefill(q, cache, meta, 1.0, out=q.half())


def test_copy_blocks_rejects_bad_arguments() -> None:
    cache = torch.zeros(2, 2, 4, 16, 2, 64, device=DEVICE)
    pairs = torch.tensor([[0, 1]], device=DEVICE)
    with pytest.raises(ValueError, match=r"pairs must be \[num_pairs, 2\], got \[1, 3\]"):
        copy_blocks(cache, torch.zeros(1, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="pairs must be int64, got int32"):
        copy_blocks(cache, pairs.int())
    with pytest.raises(ValueError, match="cache must have 6 dims"):
        copy_blocks(cache[0], pairs)
    with pytest.raises(ValueError, match="cache blocks must be contiguous"):
        copy_blocks(cache.transpose(3, 4), pairs)


# -- serving sizes on a GPU -------------------------------------------------

SERVING = Shape(32, 8, 128, 16, torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_seqs", [64, 2], ids=["64seqs", "2seqs-split"])
def test_gpu_paged_decode(rng: torch.Generator, num_seqs: int) -> None:
    batch = paged_batch(rng, SERVING, [(2047 - 3 * i, 1) for i in range(num_seqs)])
    scale = SERVING.head_dim**-0.5
    out = paged_decode(batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q))
    ref = paged_decode_ref(batch.q, batch.cache, batch.meta, scale)
    assert rel_error(out, ref) <= TOLERANCE[SERVING.dtype]


@pytest.mark.gpu
@needs_gpu
def test_gpu_paged_decode_verification_spans(rng: torch.Generator) -> None:
    # 64 sequences near 2048 positions, half verifying 5 tokens and half
    # decoding one: split over partitions on every GPU this runs on.
    spans = [(2043 - 3 * i, 5) for i in range(32)] + [(2047 - i, 1) for i in range(32)]
    batch = paged_batch(rng, SERVING, spans)
    scale = SERVING.head_dim**-0.5
    out = paged_decode(batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q))
    ref = paged_prefill_ref(batch.q, batch.cache, batch.meta, scale)
    assert rel_error(out, ref) <= TOLERANCE[SERVING.dtype]
    split = paged_decode(batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q), 256)
    assert rel_error(split, ref) <= TOLERANCE[SERVING.dtype]


@pytest.mark.gpu
@needs_gpu
def test_gpu_paged_prefill(rng: torch.Generator) -> None:
    # 64 sequences near 2048 positions: decode tokens, verification spans and
    # prefill chunks of up to 512 tokens mixed in one launch.
    lengths = [1, 5, 64, 512]
    spans = [(2048 - lengths[i % 4] - i, lengths[i % 4]) for i in range(64)]
    batch = paged_batch(rng, SERVING, spans)
    scale = SERVING.head_dim**-0.5
    out = paged_prefill(batch.q, batch.cache, batch.meta, scale, poisoned_like(batch.q))
    ref = paged_prefill_ref(batch.q, batch.cache, batch.meta, scale)
    assert rel_error(out, ref) <= TOLERANCE[SERVING.dtype]


@pytest.mark.gpu
@needs_gpu
def test_gpu_write_kv_and_copy_blocks(rng: torch.Generator) -> None:
    batch = paged_batch(rng, SERVING, [(2048 - 5, 5)] * 64, spare_blocks=64)
    num_tokens = batch.q.shape[0]
    k = randn(rng, num_tokens, SERVING.kv_heads, SERVING.head_dim, dtype=SERVING.dtype)
    v = randn(rng, num_tokens, SERVING.kv_heads, SERVING.head_dim, dtype=SERVING.dtype)
    ours = batch.cache
    ours.view(2, -1, SERVING.kv_heads, SERVING.head_dim)[:, batch.meta.slot_mapping] = float("nan")
    ref = ours.clone()
    write_kv(ours, k, v, batch.meta.slot_mapping)
    write_kv_ref(ref, k, v, batch.meta.slot_mapping)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)

    layers = torch.stack([ours.nan_to_num()] * 4)
    num_blocks = layers.shape[2]
    pairs = torch.stack([torch.arange(64), torch.arange(num_blocks - 64, num_blocks)], dim=1)
    layers_ref = layers.clone()
    copy_blocks(layers, pairs.to(DEVICE))
    copy_blocks_ref(layers_ref, pairs.to(DEVICE))
    assert torch.equal(layers, layers_ref)


@pytest.mark.gpu
@needs_gpu
def test_gpu_triton_attention_matches_torch_attention(rng: torch.Generator) -> None:
    spans = [(2047, 1)] * 32 + [(2043, 5)] * 24 + [(1536, 512)] * 8
    batch = paged_batch(rng, SERVING, spans)
    cache = batch.cache.nan_to_num()
    scale = SERVING.head_dim**-0.5
    out = TritonAttention().attend(batch.q, cache, batch.meta, scale)
    ref = TorchAttention().attend(batch.q, cache, torch_metadata(batch, SERVING), scale)
    assert rel_error(out, ref) <= TOLERANCE[SERVING.dtype]
