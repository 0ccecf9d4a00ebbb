"""Triton kernels for the paged KV cache, one kernel per module, each with a
launcher that validates its arguments and a pure-torch `*_ref` twin:

- `kv_write`: scatter new K/V rows into their slots.
- `paged_decode`: attention for short spans: one token per sequence, or a
  verification's k + 1 (split-K over the context).
- `paged_prefill`: attention for long spans (prefill chunks).
- `block_copy`: copy-on-write block copies across all layers.

`specpage.attention.triton.TritonAttention` puts them behind the attention
backend protocol. This module holds what the launchers share: the batch they
read (`PagedSpans`), argument checks that raise ValueError naming the
problem, and the choice of the dot-product dtype.

The kernels import nothing from `specpage.attention`, which imports them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


class PagedSpans(Protocol):
    """What the attention launchers read of a batch of spans (the Triton
    backend's metadata is one): each sequence's blocks, context, and the rows
    of its new tokens in q."""

    @property
    def block_tables(self) -> torch.Tensor: ...  # [num_seqs, max_blocks] int64

    @property
    def context_lens(self) -> torch.Tensor: ...  # [num_seqs] int64, KV after the span's writes

    @property
    def query_start(self) -> torch.Tensor: ...  # [num_seqs + 1] int64, first row of each span

    @property
    def max_query(self) -> int: ...  # longest span, in tokens

    @property
    def max_context(self) -> int: ...  # longest context, in tokens


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds."""
    if not condition:
        raise ValueError(message)


def check_tensor(
    name: str, tensor: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]
) -> None:
    """Rank and dtype of one argument."""
    require(
        tensor.dim() == ndim,
        f"{name} must have {ndim} dims, got shape {list(tensor.shape)}",
    )
    allowed = " or ".join(dtype_name(d) for d in dtypes)
    require(
        tensor.dtype in dtypes,
        f"{name} must be {allowed}, got {dtype_name(tensor.dtype)}",
    )


def check_device(reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every tensor on the device of the reference (the KV cache)."""
    for name, tensor in tensors.items():
        require(
            tensor.device == reference.device,
            f"{name} is on {tensor.device}, but the cache is on {reference.device}",
        )


def check_layer_cache(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """One layer's cache [2, num_blocks, block_size, kv_heads, head_dim] with
    unit stride along head_dim; returns (num_blocks, block_size, kv_heads, head_dim)."""
    check_tensor("cache", cache, 5, FLOAT_DTYPES)
    two, num_blocks, block_size, kv_heads, head_dim = cache.shape
    require(two == 2, f"cache dim 0 must be 2 (K, V), got {two}")
    check_head_dim(head_dim)
    require_unit_stride("cache", cache)
    return num_blocks, block_size, kv_heads, head_dim


def check_head_dim(head_dim: int) -> None:
    # Tiles span the whole head, and tl.arange needs a power of two; the dot
    # products need at least 16 along every dimension.
    require(
        head_dim >= 16 and head_dim & (head_dim - 1) == 0,
        f"head_dim must be a power of two >= 16, got {head_dim}",
    )


def require_unit_stride(name: str, tensor: torch.Tensor) -> None:
    """The last dim is read as one contiguous vector per row."""
    require(
        tensor.stride(-1) == 1,
        f"{name} must have unit stride along its last dim, got strides {tensor.stride()}",
    )


def check_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: PagedSpans, out: torch.Tensor | None
) -> int:
    """Arguments shared by both attention launchers; returns the query heads
    per KV head (groups)."""
    _, _, kv_heads, head_dim = check_layer_cache(cache)
    check_tensor("q", q, 3, (cache.dtype,))
    heads = q.shape[1]
    require(
        q.shape[2] == head_dim,
        f"q head_dim {q.shape[2]} does not match the cache's {head_dim}",
    )
    require(
        heads % kv_heads == 0,
        f"q heads ({heads}) must be a multiple of the cache's kv_heads ({kv_heads})",
    )
    require_unit_stride("q", q)
    check_tensor("block_tables", meta.block_tables, 2, (torch.int64,))
    check_tensor("context_lens", meta.context_lens, 1, (torch.int64,))
    num_seqs = meta.context_lens.shape[0]
    require(
        meta.block_tables.shape[0] == num_seqs,
        f"block_tables has {meta.block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    require_unit_stride("block_tables", meta.block_tables)
    require(meta.context_lens.is_contiguous(), "context_lens must be contiguous")
    check_device(cache, q=q, block_tables=meta.block_tables, context_lens=meta.context_lens)
    if out is not None:
        require(
            out.shape == q.shape and out.dtype == q.dtype,
            f"out must be {dtype_name(q.dtype)} {list(q.shape)} like q, "
            f"got {dtype_name(out.dtype)} {list(out.shape)}",
        )
        require_unit_stride("out", out)
        check_device(cache, out=out)
    return heads // kv_heads


def check_query_start(cache: torch.Tensor, meta: PagedSpans) -> None:
    """Each span's first token row, on the cache's device, and max_query."""
    num_seqs = meta.context_lens.shape[0]
    check_tensor("query_start", meta.query_start, 1, (torch.int64,))
    require(
        meta.query_start.shape[0] == num_seqs + 1,
        f"query_start must have num_seqs + 1 = {num_seqs + 1} entries, "
        f"got {meta.query_start.shape[0]}",
    )
    require(meta.query_start.is_contiguous(), "query_start must be contiguous")
    require(
        meta.query_start.device == cache.device,
        f"query_start is on {meta.query_start.device}, but the cache is on {cache.device}",
    )
    require(meta.max_query >= 1, f"max_query must be >= 1, got {meta.max_query}")


def gather_context_ref(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V [context_len, kv_heads * groups, head_dim] in
    fp32, each KV head repeated for the query heads that share it."""
    block_size = cache.shape[2]
    positions = torch.arange(context_len, device=cache.device)
    blocks, offsets = block_table[positions // block_size], positions % block_size
    k = cache[0, blocks, offsets].float().repeat_interleave(groups, dim=1)
    v = cache[1, blocks, offsets].float().repeat_interleave(groups, dim=1)
    return k, v


def is_interpreted(kernel: object) -> bool:
    """Triton fixes interpreter versus compiler when it decorates a kernel."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def dot_config(dtype: torch.dtype, kernel: object) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) for the kernel's tl.dot calls.

    On a GPU, fp16/bf16 operands go to the tensor cores as they are (with fp32
    accumulation) and fp32 operands use full-precision ("ieee") products
    rather than TF32. The interpreter runs on numpy, which has no bfloat16, so
    there every operand is widened to fp32.
    """
    if dtype == torch.float32 or is_interpreted(kernel):
        return tl.float32, "ieee"
    return TRITON_DTYPES[dtype], "tf32"
