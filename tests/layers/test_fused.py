"""The native fused elementwise kernels (specpage/kernels/cpu/fused_ops.cpp)
against the torch ops they replace: bf16 results equal them but for rare
last-bit differences of an fp32 sum or exp, fp32 results are within a few
ulps; shapes and dtypes they do not take fall back to the torch ops."""

import pytest
import torch
import torch.nn.functional as F

from specpage.kernels.cpu.native import native_kernels
from specpage.layers import fused
from specpage.layers.rope import apply_rope, cos_sin, inverse_frequencies
from specpage.layers.rope_config import RopeConfig

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels not built")

DTYPES = [torch.float32, torch.bfloat16]


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: a few ulps apart; bf16: equal in all but a few elements, which
    are one bf16 step apart (an fp32 sum in another order can round the
    other way)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=4e-6, atol=1e-6)
        return
    differ = ours != ref
    assert float(differ.float().mean()) < 0.01
    step = ref.float().abs().clamp_min(1e-30) * 2**-7
    assert bool(((ours.float() - ref.float()).abs() <= step * 1.01)[differ].all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: split over threads
def test_rms_norm_and_its_add_equal_the_torch_ops(dtype, rows):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    weight = (torch.rand(576) + 0.5).to(dtype)
    with torch.inference_mode():
        close(fused.rms_norm(x, weight, 1e-5), fused.rms_norm_ref(x, weight, 1e-5))
        total, normed = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    close(normed, fused.rms_norm_ref(x + residual, weight, 1e-5))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_a_float32_scale_multiplies_before_the_rounding(rows):
    """Gemma's norm on bf16 x: (1 + weight) in fp32 times the normed x
    before the one rounding, by the same kernels given a float32 weight."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, 640) * 3).bfloat16()
    residual = torch.randn(rows, 640).bfloat16()
    scale = 1.0 + torch.randn(640).bfloat16().float()
    with torch.inference_mode():
        ours = fused.scaled_rms_norm(x, scale, 1e-6)
        close(ours, fused.scaled_rms_norm_ref(x, scale, 1e-6))
        # not the bf16 weight's result: that rounds before the scale
        assert not torch.equal(ours, fused.rms_norm(x, scale.bfloat16(), 1e-6))
        total, normed = fused.scaled_add_rms_norm(x, residual, scale, 1e-6)
    assert torch.equal(total, x + residual)
    close(normed, fused.scaled_rms_norm_ref(x + residual, scale, 1e-6))


@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows", [1, 300])
def test_normed_add_rms_norm_is_the_norm_then_the_add_and_norm(dtype, weight_dtype, rows):
    """Gemma 3's branch norm, residual add and next norm in one call give,
    bit for bit, rms_norm then add_rms_norm."""
    torch.manual_seed(rows)
    kernels = native_kernels()
    branch, residual = (torch.randn(rows, 640).to(dtype) for _ in range(2))
    branch_weight, weight = (torch.randn(640).to(weight_dtype) for _ in range(2))
    with torch.inference_mode():
        total, normed = kernels.add_rms_norm(kernels.rms_norm(branch, branch_weight, 1e-6),
                                             residual, weight, 1e-6)
        ours = kernels.normed_add_rms_norm(branch, residual, branch_weight, weight, 1e-6)
    assert torch.equal(ours[0], total) and torch.equal(ours[1], normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_the_torch_ops(dtype):
    torch.manual_seed(1)
    gate_up = (torch.randn(33, 2 * 1536) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 88.0])
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        close(fused.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_equals_the_torch_ops(dtype):
    """Gemma's GeGLU: F.gelu(gate, approximate="tanh") * up in torch's
    order, its tanh through exp. Below x = -5, 1 + tanh(z) is within a step
    or two of fp32's grid near -1 of 0: there both give 0 or a value below
    2^-22 |x up| (0 or not as each tanh's last bit falls)."""
    torch.manual_seed(1)
    gate_up = (torch.randn(33, 2 * 2048) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 88.0])
    with torch.inference_mode():
        ours = fused.gelu_tanh_and_mul(gate_up)
        ref = fused.gelu_tanh_and_mul_ref(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    tail = gate <= -5
    bound = 2**-22 * (gate * up).abs()
    assert bool((ours.float().abs() <= bound)[tail].all())
    assert bool((ref.float().abs() <= bound)[tail].all())
    close(torch.where(tail, ref, ours), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128)])
def test_rope_equals_the_torch_ops(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(heads)
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 17, 300, 4095])
    cos, sin = cos_sin(inverse_frequencies(RopeConfig(theta=10000.0), head_dim), positions, dtype)
    with torch.inference_mode():
        q, k, v = fused.rope_qk(qkv, cos, sin, heads, kv_heads)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    close(q, apply_rope(qkv[:, :q_size].view(tokens, heads, head_dim), cos, sin))
    close(k, apply_rope(qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim),
                        cos, sin))
    assert torch.equal(v, qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_into_the_cache_writes_rope_qks_k_and_v_at_their_slots(dtype):
    """rope_qk_into_cache (the direct layer loop's) gives rope_qk's q, and
    leaves in the cache what rope_qk's k and v written by slot would."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([3, 40, 41, 700])
    cos, sin = cos_sin(inverse_frequencies(RopeConfig(theta=10000.0), head_dim), positions, dtype)
    slots = torch.tensor([5, 37, 0, 63])  # out of order, across blocks of 16
    cache = torch.randn(2, 4, 16, kv_heads, head_dim).to(dtype)
    expected = cache.clone()
    kernels = native_kernels()
    with torch.inference_mode():
        q, k, v = fused.rope_qk(qkv, cos, sin, heads, kv_heads)
        ours = kernels.rope_qk_into_cache(qkv, cos, sin, heads, kv_heads, cache, slots)
    flat = expected.view(2, -1, kv_heads, head_dim)
    flat[0][slots], flat[1][slots] = k, v
    assert torch.equal(ours, q)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot 64 of token 3 is outside the cache's 64 slots"):
        kernels.rope_qk_into_cache(qkv, cos, sin, heads, kv_heads, cache,
                                   torch.tensor([0, 1, 2, 64]))


@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32)])
def test_norm_rope_into_the_cache_is_the_norms_then_rope_into_the_cache(dtype, weight_dtype):
    """norm_rope_qk_into_cache (Gemma 3's and Qwen3's q/k norms in the
    native layer stack) gives, bit for bit, what rms_norm of each q and k
    head, their rows put back beside v, then rope_qk_into_cache give: q,
    and the cache's K and V rows. Tokens split over threads (300) too."""
    torch.manual_seed(2)
    heads, kv_heads, head_dim = 4, 1, 256
    kernels = native_kernels()
    for tokens in (1, 5, 300):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
        q_norm, k_norm = (torch.randn(head_dim).to(weight_dtype) for _ in range(2))
        positions = torch.arange(tokens) * 3 + 1
        cos, sin = cos_sin(inverse_frequencies(RopeConfig(theta=10000.0), head_dim), positions,
                           dtype)
        slots = torch.randperm(tokens + 20)[:tokens]
        cache = torch.randn(2, (tokens + 20 + 15) // 16, 16, kv_heads, head_dim).to(dtype)
        expected = cache.clone()
        q_width, k_width = heads * head_dim, kv_heads * head_dim
        with torch.inference_mode():
            normed = torch.cat([
                kernels.rms_norm(qkv[:, :q_width].reshape(-1, head_dim), q_norm, 1e-6)
                .view(tokens, q_width),
                kernels.rms_norm(qkv[:, q_width:q_width + k_width].reshape(-1, head_dim),
                                 k_norm, 1e-6).view(tokens, k_width),
                qkv[:, q_width + k_width:]], dim=1)
            q = kernels.rope_qk_into_cache(normed, cos, sin, heads, kv_heads, expected, slots)
            ours = kernels.norm_rope_qk_into_cache(qkv, q_norm, k_norm, 1e-6, cos, sin, heads,
                                                   kv_heads, cache, slots)
        assert torch.equal(ours, q)
        assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        kernels.norm_rope_qk_into_cache(qkv, torch.ones(head_dim // 2), k_norm, 1e-6, cos, sin,
                                        heads, kv_heads, cache, slots)


def test_what_the_kernels_do_not_take_runs_the_torch_ops():
    """fp16, widths that are not whole vectors and autograd take the torch
    ops, with the same results as the references."""
    x = torch.randn(3, 40, dtype=torch.float16)
    weight = torch.ones(40, dtype=torch.float16)
    with torch.inference_mode():
        assert torch.equal(fused.rms_norm(x, weight, 1e-6), fused.rms_norm_ref(x, weight, 1e-6))
        odd = torch.randn(2, 2 * 40)
        assert torch.equal(fused.silu_and_mul(odd), F.silu(odd[:, :40]) * odd[:, 40:])
    x = torch.randn(2, 64, requires_grad=True)
    out = fused.rms_norm(x, torch.ones(64), 1e-6)
    out.sum().backward()  # the torch ops, so a gradient flows
    assert x.grad is not None


def test_the_kernels_refuse_bad_shapes_by_name():
    kernels = native_kernels()
    with pytest.raises(RuntimeError, match="width a multiple of 16"):
        kernels.rms_norm(torch.zeros(2, 40), torch.ones(40), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        kernels.rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="qkv's width"):
        kernels.rope_qk(torch.zeros(2, 64 * 4), torch.zeros(2, 64), torch.zeros(2, 64), 3, 1)
