"""The CPU products (specpage/layers/products.py): whichever way a row count
takes (padded W @ x.T, oneDNN's prepacked weight, the native kernels), the
result is F.linear's, and a prepacked weight follows its module's weight
through a dtype change."""

import re
import subprocess

import pytest
import torch

from specpage.kernels.cpu import features as cpu
from specpage.kernels.cpu.native import native_kernels
from specpage.layers.linear import Linear
from specpage.layers.products import (
    GEMV_MAX_ROWS,
    PANELS_MAX_ROWS,
    PackedWeight,
    bf16_kernels,
    cpu_linear,
    native_product,
    panels_take,
    uses_onednn,
)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 32, 33, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_gives_f_linear(rows, dtype):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96).to(dtype)
    weight, bias = torch.randn(200, 96).to(dtype), torch.randn(200).to(dtype)
    ours = cpu_linear(x, weight, bias, PackedWeight())
    assert ours.shape == (rows, 200) and ours.dtype == dtype
    ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(ours.float(), ref, rtol=tolerance, atol=tolerance * 10)


def test_onednn_only_where_the_cpu_has_avx512():
    weight = torch.zeros(8, 8)
    assert uses_onednn(weight, 32) == (cpu.has_avx512() and torch.backends.mkldnn.is_available())
    assert not uses_onednn(weight, 1)  # a single fp32 row stays on padded W @ x.T
    assert not uses_onednn(weight.half(), 32)  # no table for fp16


@torch.inference_mode()
def test_a_packed_weight_follows_its_module_to_another_dtype():
    torch.manual_seed(0)
    linear = Linear(64, 48, bias=False)
    x = torch.randn(8, 64)
    first = linear(x)
    torch.testing.assert_close(first, x @ linear.weight.T, rtol=1e-5, atol=1e-5)
    linear = linear.to(torch.bfloat16)
    second = linear(x.bfloat16())
    assert second.dtype == torch.bfloat16
    torch.testing.assert_close(second.float(), first, rtol=2e-2, atol=5e-2)


gemv = pytest.mark.skipif(bf16_kernels() is None, reason="no AVX-512 BF16 kernel in this build")


@gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 16, 17])
@pytest.mark.parametrize(("out", "inputs"), [(208, 96), (576, 1536), (960, 576)])
def test_few_bf16_rows_on_the_native_kernel_give_f_linear(rows, out, inputs):
    """bf16 products of up to GEMV_MAX_ROWS rows run on the native kernel
    (fp32 sums of exact bf16 products, then rounded): F.linear's result in
    fp32, rounded to bf16, within a bf16 step of the output's size. More
    rows take the panels, or oneDNN where the CPU has AMX."""
    torch.manual_seed(rows + out)
    x = torch.randn(rows, inputs).bfloat16()
    weight, bias = (torch.randn(out, inputs) * 0.05).bfloat16(), torch.randn(out).bfloat16()
    packed = PackedWeight()
    gemv_op = bf16_kernels().bf16_gemv.default  # type: ignore[union-attr]
    with torch.inference_mode():
        call = native_product(weight, packed, rows)  # what cpu_linear runs for bf16 x
        if rows <= GEMV_MAX_ROWS:
            assert call is not None and call[0] == gemv_op
        else:
            assert (call is None) == cpu.has_amx() and (call is None or call[0] != gemv_op)
        ours = cpu_linear(x, weight, bias, packed)
    ref = torch.nn.functional.linear(x.float(), weight.float()) + bias.float()
    assert ours.shape == (rows, out) and ours.dtype == torch.bfloat16
    assert float((ours.float() - ref).abs().max()) <= float(ref.abs().max()) * 2**-7


@gemv
@pytest.mark.parametrize("rows", [9, 17, 24, 31, 64])
@pytest.mark.parametrize(("out", "inputs"), [(208, 96), (224, 64), (576, 1536)])
def test_a_few_dozen_bf16_rows_on_the_panel_kernel_give_f_linear(rows, out, inputs):
    """The panel kernel (panels of 48 outputs, the last one 16 or 32 here)
    gives F.linear's result in fp32, rounded to bf16, within a bf16 step of
    the output's size; the panels are packed once per weight. Past
    GEMV_MAX_ROWS, up to PANELS_MAX_ROWS bf16 rows run on it where the CPU
    has no AMX; with AMX oneDNN takes them (its tiles beat the panels)."""
    torch.manual_seed(rows + out)
    x = torch.randn(rows, inputs).bfloat16()
    weight, bias = (torch.randn(out, inputs) * 0.05).bfloat16(), torch.randn(out).bfloat16()
    packed = PackedWeight()
    kernels = bf16_kernels()
    panels_op = kernels.bf16_panels_product.default  # type: ignore[union-attr]
    with torch.inference_mode():
        call = native_product(weight, packed, rows)  # what cpu_linear runs for bf16 x
        if cpu.has_amx():
            assert call is None and not panels_take(weight, rows)
        else:
            assert call is not None and call[0] == panels_op and panels_take(weight, rows)
        dispatched = cpu_linear(x, weight, bias, packed)
        panels = packed.panels(weight)
        assert packed.panels(weight) is panels
        ours = kernels.bf16_panels_product(x, panels, out) + bias  # type: ignore[union-attr]
    ref = torch.nn.functional.linear(x.float(), weight.float()) + bias.float()
    for y in (ours, dispatched):
        assert y.shape == (rows, out) and y.dtype == torch.bfloat16
        assert float((y.float() - ref).abs().max()) <= float(ref.abs().max()) * 2**-7
    assert not panels_take(weight, PANELS_MAX_ROWS + 1)


@gemv
def test_the_native_product_refuses_what_it_cannot_take_by_name():
    kernels = native_kernels()
    x = torch.zeros(1, 96, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.bf16_gemv(x, torch.zeros(200, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        kernels.bf16_gemv(torch.zeros(17, 96, dtype=torch.bfloat16),
                          torch.zeros(208, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        kernels.bf16_gemv(x.float(), torch.zeros(208, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out a multiple of 16"):
        kernels.bf16_panels(torch.zeros(200, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"packed must be bf16_panels of an \[208, 96\]"):
        kernels.bf16_panels_product(torch.zeros(20, 96, dtype=torch.bfloat16),
                                    torch.zeros(208 * 95, dtype=torch.bfloat16), 208)
    # an fp32 weight stays on oneDNN/BLAS
    assert native_product(torch.zeros(208, 96), PackedWeight(), x.shape[0]) is None
    tiles = torch.zeros(13, 3, 384, dtype=torch.uint8)  # 208 outputs x 96 inputs
    with pytest.raises(RuntimeError, match="in a multiple of 32"):
        kernels.int4_gemv(torch.zeros(1, 100, dtype=torch.bfloat16), tiles)
    with pytest.raises(RuntimeError, match=r"tiles must be contiguous uint8 \[out / 16, in / 32, "
                                           r"320 or 384\].* for x of 128 inputs"):
        kernels.int4_gemv(torch.zeros(1, 128, dtype=torch.bfloat16), tiles)
    with pytest.raises(RuntimeError, match="at least one row"):
        kernels.int4_gemv(torch.zeros(0, 96, dtype=torch.bfloat16), tiles)
    assert kernels.int4_gemv(x, tiles).shape == (1, 208)


@gemv
def test_the_native_product_takes_up_to_16_rows_in_groups():
    """More rows than one group of the kernel (8) share reads group by group."""
    torch.manual_seed(12)
    x = torch.randn(12, 576).bfloat16()
    weight = (torch.randn(960, 576) * 0.05).bfloat16()
    ours = native_kernels().bf16_gemv(x, weight).float()
    ref = x.float() @ weight.float().T
    assert float((ours - ref).abs().max()) <= float(ref.abs().max()) * 2**-7


def _loaded_library() -> str:
    """The path of the native kernels' library this process loaded."""
    native_kernels()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "specpage_cpu_" in line}
    assert len(paths) == 1, paths
    return paths.pop()


@pytest.mark.parametrize("kernel", ["int4_gemv", "int8x_gemv"])
def test_the_int4_products_ask_for_their_weights_ahead(kernel):
    """GCC once deleted every prefetch of these products (a function of
    prefetches alone looked to it like one without effects), and nothing
    but their speed showed it: their built loops must hold prefetches."""
    from specpage.layers import quant

    built = bf16_kernels() is not None if kernel == "int4_gemv" else quant.int8x_kernels()
    if not built:
        pytest.skip(f"{kernel} is not built for this CPU")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", _loaded_library()],
                             capture_output=True, text=True, check=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", listing)
    names = [body.split("\n", 1)[0] for body in functions]
    caller = {"int4_gemv": "int4_gemv", "int8x_gemv": "int8x_product"}[kernel]  # (its body)
    loops = [body for name, body in zip(names, functions, strict=True)
             if "for_blocks<" in name and f"::{caller}(" in name]
    assert loops, f"no for_blocks of {kernel} in the library"
    assert any("prefetcht" in body for body in loops)
