"""K-quant blocks and their products (specpage/layers/kquant.py,
kernels/cpu/kquant_gemv.cpp): the reference dequantization against gguf-py's,
bit for bit; the native products against the dequantized weights times x
taken to int8 as the kernels take it; fused parts of several types; rows
taken and stacked; each row's result the same alone or in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specpage.layers import kquant
from specpage.layers.kquant import (
    FORMATS,
    SUPER_BLOCK,
    KQuantBlocks,
    KQuantLinear,
    UnsupportedBlocks,
    kquant_kernels,
)
from specpage.layers.products import row_invariant

native = pytest.mark.skipif(kquant_kernels() is None, reason="the native kernels are not built")
TYPES = tuple(FORMATS)
ROWS = (1, 3, 8, 16, 17, 64, 200)
SHAPES = ((256, 512), (1536, 576))  # (in, out)
# where each type's fp16 scales sit in its super-block
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> KQuantBlocks:
    """Random bytes, with every fp16 d and dmin a finite, moderate value."""
    rng = np.random.default_rng(seed)
    block_bytes = FORMATS[type_name].block_bytes
    raw = rng.integers(0, 256, (rows, cols // SUPER_BLOCK, block_bytes), dtype=np.uint8)
    for at in HALVES[type_name]:
        scale = (rng.uniform(0.5, 2.0, raw.shape[:2]) * 1e-3).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return KQuantBlocks.from_gguf("blk.0.test.weight", type_name,
                                  raw.reshape(rows, cols // SUPER_BLOCK * block_bytes))


def q8k_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels take it (llama.cpp's Q8_K): per row and 256 values,
    d·q with d = max |x| / 127 and q = round(x · 127 / max |x|) to nearest
    even, a block whose max |x| is below 2^-90 taken as zero; fp64."""
    blocks = x.float().view(x.shape[0], -1, SUPER_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # (127.0 / amax would be amax.reciprocal() * 127: two roundings)
    inverse = torch.where(amax >= 2.0**-90, torch.full_like(amax, 127.0) / amax,
                          torch.zeros_like(amax))
    return (torch.round(blocks * inverse).double() * (amax / 127).double()).view(x.shape)


def check_close(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                rounding: float = 0.0) -> None:
    """y against x @ weight.T in fp64, each output within what fp32 sums of
    its terms may lose (the int32 sums are exact), and `rounding` of itself
    (y rounded to bf16: 2^-8)."""
    exact = x.double() @ weight.double().T
    bound = 1e-5 * (x.double().abs() @ weight.double().abs().T) + rounding * exact.abs() + 1e-30
    assert bool(((y.double() - exact).abs() <= bound).all()), \
        float(((y.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_gguf_py_bit_for_bit(type_name):
    blocks = random_blocks(type_name, 24, 768)
    ours = blocks.dequantize()
    theirs = gguf_dequantize(blocks.data.numpy(), GGMLQuantizationType[type_name])
    assert ours.shape == (24, 768) and theirs.shape == (24, 768)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@native
@pytest.mark.parametrize("type_name", TYPES)
def test_the_native_dequantization_is_the_reference_in_bf16(type_name):
    blocks = random_blocks(type_name, 37, 512, seed=1)  # two tiles and 5 outputs
    kernels, ggml_type = kquant_kernels(), blocks.format.ggml_type
    dense = kernels.kquant_dequantize(kernels.kquant_tiles(blocks.data, ggml_type), ggml_type, 37)
    assert torch.equal(dense, blocks.dequantize().bfloat16())


@native
@pytest.mark.parametrize("type_name", TYPES)
def test_tiles_hold_the_blocks_bytes_and_give_them_back(type_name):
    """Tiles of 16 outputs: the same bytes, the last tile's missing outputs
    zero; untiled, the blocks as the GGUF stores them."""
    kernels = kquant_kernels()
    for rows in (1, 16, 21):
        blocks = random_blocks(type_name, rows, 768, seed=rows)
        ggml_type = blocks.format.ggml_type
        tiles = kernels.kquant_tiles(blocks.data, ggml_type)
        assert tiles.shape == (-(-rows // 16), 3 * 16 * blocks.format.block_bytes)
        assert sorted(tiles.flatten().tolist()) == sorted(
            blocks.data.flatten().tolist() + [0] * (tiles.numel() - blocks.data.numel()))
        assert torch.equal(kernels.kquant_untile(tiles, ggml_type, rows), blocks.data)
    with pytest.raises(RuntimeError, match="kquant_gemv: tiles must be"):
        y = torch.empty(1, 64)
        kernels.kquant_gemv(kernels.kquant_quantize_x(torch.randn(1, 768)), tiles, ggml_type,
                            40, y, 0)


@native
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_native_products_for_every_row_count(type_name, shape):
    n_in, n_out = shape
    blocks = random_blocks(type_name, n_out, n_in, seed=2)
    layer, weight = KQuantLinear([blocks]), blocks.dequantize()
    assert layer.native
    for rows in ROWS:
        x = torch.randn(rows, n_in)
        y = layer.int8_product(x)
        assert y.dtype == torch.float32 and y.shape == (rows, n_out)
        check_close(y, q8k_x(x), weight)
        # and x's own values, to what 8 bits per 256 lose
        exact = x.double() @ weight.double().T
        assert float((y - exact).norm() / exact.norm()) < 0.02


@native
@pytest.mark.parametrize("type_name", TYPES)
def test_many_rows_take_the_weights_dequantized_to_bf16(type_name, monkeypatch):
    """Tiles of the weights in bf16 (a tile smaller than a run, so that
    several tiles fill its columns) times x in bf16."""
    monkeypatch.setattr(kquant, "DENSE_TILE_BYTES", 2 * 512 * 48)
    parts = [random_blocks(type_name, 80, 512, seed=12), random_blocks("Q6_K", 32, 512, seed=13)]
    layer = KQuantLinear(parts)
    layer.dense_tiles = True  # (a CPU without AMX never takes them: its oneDNN is the slower)
    x = torch.randn(kquant.DENSE_FROM_ROWS, 512)
    weight = torch.cat([p.dequantize() for p in parts]).bfloat16()
    y = layer(x)
    assert y.dtype == torch.float32
    # bf16 products sum in fp32; the result is rounded to bf16
    check_close(y, x.bfloat16(), weight, rounding=2 ** -8)
    assert not torch.allclose(y, layer.int8_product(x), rtol=0, atol=0)  # not the int8 way


@native
def test_bf16_x_gives_bf16_y():
    blocks = random_blocks("Q4_K", 64, 512, seed=3)
    x = torch.randn(5, 512).bfloat16()
    y = KQuantLinear([blocks])(x)
    assert y.dtype == torch.bfloat16
    check_close(y.float(), q8k_x(x), blocks.dequantize(), rounding=2 ** -8)


@native
def test_a_bf16_y_is_the_fp32_products_cast_bit_for_bit():
    """kquant_gemv into a bf16 y (as the native layer stack takes it for
    bf16 x) rounds each output once, to the bits that casting its fp32
    value gives, in every run's columns, tiles ending inside a run
    included; the other columns untouched."""
    kernels = kquant_kernels()
    layer = KQuantLinear(fused_parts())
    x = torch.randn(6, 512).bfloat16()
    x[4, 7] = float("nan")
    xq = kernels.kquant_quantize_x(x)
    fp32 = torch.empty(6, 2 + layer.out_features)
    bf16 = torch.full((6, 2 + layer.out_features), 3.0, dtype=torch.bfloat16)
    for tiles, (ggml_type, column, rows) in zip(layer._blocks(), layer.columns, strict=True):
        kernels.kquant_gemv(xq, tiles, ggml_type, rows, fp32, column + 1)
        kernels.kquant_gemv(xq, tiles, ggml_type, rows, bf16, column + 1)
    finite = [0, 1, 2, 3, 5]  # row 4 is NaN (whose bits the two casts spell differently)
    cast = fp32[finite, 1:-1].bfloat16()
    assert torch.equal(bf16[finite, 1:-1].view(torch.int16), cast.view(torch.int16))
    assert bf16[4, 1:-1].isnan().all() and not bf16[finite].isnan().any()
    assert (bf16[:, 0] == 3.0).all() and (bf16[:, -1] == 3.0).all()
    assert torch.equal(layer.int8_product(x, torch.bfloat16)[finite].view(torch.int16),
                       cast.view(torch.int16))


@pytest.mark.parametrize("type_name", TYPES)
def test_the_fallback_multiplies_the_dequantized_weights(type_name):
    blocks = random_blocks(type_name, 48, 512, seed=4)
    layer = KQuantLinear([blocks])
    layer.native = False
    x = torch.randn(7, 512)
    check_close(layer(x), x, blocks.dequantize())


def fused_parts() -> list[KQuantBlocks]:
    """A Q4_K_M-like qkv: q and k Q4_K, v Q6_K; then a Q5_K part and another Q4_K."""
    # (sizes that end runs inside a tile of 16: each run writes its columns only)
    return [random_blocks("Q4_K", 37, 512, seed=5), random_blocks("Q4_K", 22, 512, seed=6),
            random_blocks("Q6_K", 21, 512, seed=7), random_blocks("Q5_K", 5, 512, seed=8),
            random_blocks("Q4_K", 45, 512, seed=9)]


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=native), False])
def test_fused_parts_of_several_types(use_native):
    parts = fused_parts()
    layer = KQuantLinear(parts)
    layer.native = use_native
    assert layer.type_names == ["Q4_K", "Q6_K", "Q5_K", "Q4_K"]  # q and k joined
    assert (layer.in_features, layer.out_features) == (512, 130)
    weight = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(layer.dequantize(), weight)
    x = torch.randn(9, 512)
    check_close(layer(x), q8k_x(x) if use_native else x, weight)
    # each part alone computes its columns, bit for bit
    if use_native:
        alone = torch.cat([KQuantLinear([p])(x) for p in parts], dim=1)
        assert torch.equal(layer(x), alone)


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=native), False])
def test_a_bias_is_added_in_xs_dtype(use_native):
    blocks = random_blocks("Q5_K", 32, 256, seed=14)
    bias = torch.randn(32)
    plain, biased = KQuantLinear([blocks]), KQuantLinear([blocks], bias)
    plain.native = biased.native = use_native
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 256).to(dtype)
        y = biased(x)
        assert y.dtype == dtype
        assert torch.equal(y, plain(x) + bias.to(dtype))


def test_taking_and_stacking_rows():
    blocks = random_blocks("Q6_K", 40, 256, seed=10)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(blocks.take_rows(order).dequantize(), blocks.dequantize()[order])
    top, bottom = blocks.take_rows(torch.arange(0, 16)), blocks.take_rows(torch.arange(16, 40))
    joined = KQuantBlocks.cat([top, bottom])
    assert joined.type_name == "Q6_K" and (joined.rows, joined.cols) == (40, 256)
    assert torch.equal(joined.data, blocks.data)


@native
@pytest.mark.parametrize("type_name", TYPES)
def test_each_row_comes_out_as_if_alone(type_name):
    """The rule of layers/products.py's row_invariant, which these kernels keep
    always: a row's result does not depend on the rows beside it."""
    layer = KQuantLinear([random_blocks(type_name, 96, 768, seed=11)])
    layer.dense_tiles = True  # as on a CPU with AMX
    x = torch.randn(33, 768)
    alone = torch.cat([layer(x[r : r + 1]) for r in range(33)])
    with row_invariant(True):
        for rows in (2, 5, 8, 9, 16, 17, 33):
            y = layer(x[:rows])
            differ = [r for r in range(rows) if not torch.equal(y[r], alone[r])]
            assert not differ, f"{rows} rows: rows {differ} differ from each alone"
        shuffled = layer(x.flip(0))
        assert torch.equal(shuffled.flip(0), alone)
        # rows past DENSE_FROM_ROWS too: the int8 kernels take every row count here
        many = torch.cat([x] * (kquant.DENSE_FROM_ROWS // 33 + 1))
        assert torch.equal(layer(many)[:33], alone)


@native
def test_a_row_that_is_not_finite_comes_out_nan_alone():
    layer = KQuantLinear([random_blocks("Q6_K", 32, 512, seed=15)])
    x = torch.randn(3, 512)
    x[1, 300] = float("inf")
    y = layer(x)
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
    assert torch.equal(y[[0, 2]], layer(x[[0, 2]]))


@native
def test_a_block_of_x_below_2_to_the_minus_90_counts_as_zero():
    """x's blocks of 256 whose largest value is below 2^-90 (subnormal
    products, whose arithmetic is slow on x86) contribute nothing; a block
    at 2^-90 contributes as ever, and a row's other blocks too."""
    layer = KQuantLinear([random_blocks("Q4_K", 32, 512, seed=16)])
    x = torch.randn(3, 512)
    x[:2, 256:] = 0.0
    x[0, :256] *= 2.0**-100  # below: nothing
    x[1, :256] = x[1, :256] / x[1, :256].abs().max() * 2.0**-90  # at the floor: counted
    x[2, :256] *= 2.0**-100  # below, beside a block of normal values
    y = layer.int8_product(x)
    check_close(y, q8k_x(x), layer.dequantize())
    assert bool((y[0] == 0).all()) and bool((y[1] != 0).any())
    assert torch.equal(y[2], layer.int8_product(torch.cat([torch.zeros(1, 256), x[2:, 256:]],
                                                          1))[0])


@pytest.mark.parametrize("type_name", ["Q2_K", "IQ4_XS", "Q8_0"])
def test_an_unsupported_type_is_named(type_name):
    raw = np.zeros((4, 144), dtype=np.uint8)
    with pytest.raises(UnsupportedBlocks, match=(
            f"blk.3.ffn_down.weight is {type_name}; K-quant weights are read from "
            "Q4_K, Q5_K, Q6_K blocks only")):
        KQuantBlocks.from_gguf("blk.3.ffn_down.weight", type_name, raw)


def test_rows_of_partial_super_blocks_are_refused():
    with pytest.raises(UnsupportedBlocks, match="blk.0.attn_q.weight .Q4_K.*144-byte"):
        KQuantBlocks.from_gguf("blk.0.attn_q.weight", "Q4_K", np.zeros((4, 100), np.uint8))
