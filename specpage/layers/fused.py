"""A decoder layer's elementwise work: RMSNorm (alone or after the residual
add), SiLU- and GELU-and-mul and the rotary embedding of q and k, each one native pass
(specpage/kernels/cpu/fused_ops.cpp) where it applies: CPU tensors in fp32
or bf16 whose widths are whole vectors, with autograd off. Elsewhere the
torch ops below run, which are also what the kernels are tested against.

The kernels round to the dtype where the torch ops do, so bf16 results are
the torch ops' but for the last bit of an fp32 sum or exp; fp32 results
differ from them only in the order of the sum of squares and in exp's last
bits (tests/layers/test_fused.py bounds both).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specpage.kernels.cpu.native import loaded_kernels
from specpage.layers.rope import apply_rope

LANES = 16  # the kernels' vector width: widths must be multiples of it
FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor, width: int) -> object | None:
    """The kernels, where they apply to x with rows of `width` (a multiple of LANES)."""
    if (x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or width % LANES
            or torch.is_grad_enabled()):
        return None
    return loaded_kernels()


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    """x, copied where its columns are not adjacent (a few-row product's
    output can be a transposed view, see products.few_rows_linear)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised in fp32 and cast back before the weight, as HF does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, width] normed."""
    return _norm(x, weight, eps, weight.dtype == x.dtype, rms_norm_ref)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, that sum normed); x, residual [rows, width]."""
    return _add_norm(x, residual, weight, eps, weight.dtype == x.dtype, rms_norm_ref)


def scaled_rms_norm_ref(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised and scaled in fp32, then cast, as Gemma's RMSNorm does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * scale).type_as(x)


def scaled_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, width] normed and times a float32 scale before the one
    rounding to x's dtype (Gemma's (1 + weight)): on the kernel for bf16 x."""
    return _norm(x, scale, eps, x.dtype == torch.bfloat16, scaled_rms_norm_ref)


def scaled_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, that sum through scaled_rms_norm)."""
    return _add_norm(x, residual, scale, eps, x.dtype == torch.bfloat16, scaled_rms_norm_ref)


Reference = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel_takes: bool,
          reference: Reference) -> torch.Tensor:
    """The norm kernel's result where it applies (and kernel_takes this
    weight), else reference's: the kernel takes a weight in x's dtype as a
    Llama RMSNorm's, a float32 one for bf16 x as a scale before rounding."""
    kernels = _native(x, x.shape[-1])
    if kernels is None or x.dim() != 2 or not kernel_takes:
        return reference(x, weight, eps)
    out: torch.Tensor = kernels.rms_norm(_unit_columns(x), weight, eps)  # type: ignore[attr-defined]
    return out


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              kernel_takes: bool, reference: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, that sum normed), as _norm decides."""
    kernels = _native(x, x.shape[-1])
    if kernels is None or x.dim() != 2 or residual.dtype != x.dtype or not kernel_takes:
        total = x + residual
        return total, reference(total, weight, eps)
    total, normed = kernels.add_rms_norm(_unit_columns(x), _unit_columns(residual), weight,
                                         eps)  # type: ignore[attr-defined]
    return total, normed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] (gate, then up) -> silu(gate) * up [rows, width]."""
    kernels = _native(gate_up, gate_up.shape[-1] // 2)
    if kernels is None or gate_up.dim() != 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out: torch.Tensor = kernels.silu_and_mul(_unit_columns(gate_up))  # type: ignore[attr-defined]
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] (gate, then up) -> gelu(gate) * up [rows,
    width], GELU by its tanh approximation (Gemma's GeGLU)."""
    kernels = _native(gate_up, gate_up.shape[-1] // 2)
    if kernels is None or gate_up.dim() != 2:
        return gelu_tanh_and_mul_ref(gate_up)
    out: torch.Tensor = kernels.gelu_tanh_and_mul(_unit_columns(gate_up))  # type: ignore[attr-defined]
    return out


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
            kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [tokens, (heads + 2 kv_heads) * head_dim] -> q [tokens, heads, d]
    and k [tokens, kv_heads, d] rotated by cos/sin [tokens, d], and v
    [tokens, kv_heads, d] (a view of qkv)."""
    n, head_dim = qkv.shape[0], cos.shape[-1]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    v = qkv[:, q_size + kv_size:].view(n, kv_heads, head_dim)
    kernels = _native(qkv, head_dim // 2)
    if kernels is None or cos.dtype != qkv.dtype:
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        return (apply_rope(q.view(n, heads, head_dim), cos, sin),
                apply_rope(k.view(n, kv_heads, head_dim), cos, sin), v)
    q, k = kernels.rope_qk(_unit_columns(qkv), cos, sin, heads, kv_heads)  # type: ignore[attr-defined]
    return q, k, v
