"""The int4 linears and their kernels (specpage/layers/quant.py,
kernels/cpu/int4_gemv.cpp): the kernels' tiles against the blocks' dense
weights, on bf16 x and on x taken to int8."""

from __future__ import annotations

import pytest
import torch

from specpage.layers import quant
from specpage.layers.products import bf16_kernels
from specpage.layers.quant import Int4Blocks, Int4Linear

native = pytest.mark.skipif(bf16_kernels() is None, reason="no native int4 kernel on this CPU")
both_products = pytest.mark.parametrize(
    "int8x", [False, pytest.param(True, marks=pytest.mark.skipif(
        not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU"))])


def int8_x(x: torch.Tensor) -> torch.Tensor:
    """x as int8x_gemv takes it: per row and group of 32, d q with
    d = max |x| / 127 and q = round(x / d), to nearest even, a group whose
    max |x| is below 2^-90 taken as zero; fp32."""
    groups = x.float().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax >= 2.0**-90, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(groups * inverse) * (amax / 127)).view(x.shape)


@native
@both_products
def test_the_native_kernel_computes_the_blocks_products_for_every_row_count(
        int8x: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's tiles (quant.int4_stream, or int8x_stream where x is
    taken to int8) against the blocks' dense weights: every row count it
    takes, an odd number of groups, and outputs spanning several tiles, so
    that a misplaced nibble, scale or bias shows; and a row's result is the
    same bits alone or among others."""
    monkeypatch.setattr(quant, "INT8X_PRODUCTS", int8x)
    torch.manual_seed(3)
    outputs, inputs = 48, 96
    q = torch.randint(0, 16, (outputs, inputs), dtype=torch.uint8)
    # scales and offsets fp16 cannot hold (fp32 in the tiles), and a GGUF's (fp16)
    scale, offset = torch.rand(outputs, 3) * 0.02, torch.randn(outputs, 3) * 0.1
    for tile_bytes in (384, 320):
        if tile_bytes == 320:
            scale, offset = scale.half().float(), offset.half().float()
        check_native_products(Int4Blocks(q, scale, offset, 32), tile_bytes)


def check_native_products(blocks: Int4Blocks, tile_bytes: int) -> None:
    outputs, inputs = blocks.q.shape
    weights = blocks.dequantize()
    module = Int4Linear(blocks)
    assert module.native and module.int8x == quant.INT8X_PRODUCTS
    assert module.tiles.shape == (3, 3, tile_bytes)
    op = bf16_kernels().int8x_gemv if module.int8x else bf16_kernels().int4_gemv  # type: ignore[union-attr]
    stream = quant.int8x_stream if module.int8x else quant.int4_stream
    for rows in (*range(1, 9), 13, 24):  # past 8 rows: further passes over a block
        x = torch.randn(rows, inputs).bfloat16()
        # the products of x as the kernel takes it (int8x: to int8 per 32), to
        # within the bf16 output's rounding
        expected = (int8_x(x) if module.int8x else x.float()) @ weights.T
        actual = module.int4_product(x).float()
        error = (actual - expected).abs().max() / expected.abs().max()
        assert error < 2**-7, (rows, float(error))
        if module.int8x:  # and x's own products within int8's rounding of x
            exact = x.float() @ weights.T
            assert (actual - exact).abs().max() / exact.abs().max() < 2**-5
        # each row's sums run in the same order whatever the row count
        alone = torch.cat([module.int4_product(x[r : r + 1]) for r in range(rows)])
        assert torch.equal(actual, alone.float()), rows
        # reading on into a next product's tiles (decoder_stack's) changes no bit
        chained = op(x, module.tiles, module.tiles[:1])
        assert torch.equal(chained, module.int4_product(x)), rows
    with pytest.raises(RuntimeError, match=r"next must be contiguous uint8 .* next product's"):
        op(x, module.tiles, module.tiles[..., :128])
    if tile_bytes == 320:  # fp16 scales and offsets: the same bits as fp32 ones
        as_fp32 = stream(blocks, half=False)
        assert as_fp32.shape == (3, 3, 384)
        assert torch.equal(op(x, as_fp32), module.int4_product(x))
    else:
        with pytest.raises(ValueError, match="float16 holds exactly"):
            stream(blocks, half=True)


@native
@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
def test_int8x_takes_a_group_that_is_not_finite_to_nan() -> None:
    """A group of x holding an infinity or NaN gives NaN outputs, as a bf16
    product would, and leaves the other rows alone."""
    blocks = Int4Blocks(torch.randint(0, 16, (16, 64), dtype=torch.uint8),
                        torch.full((16, 2), 0.01), torch.full((16, 2), -0.08), 32)
    tiles = quant.int8x_stream(blocks)
    x = torch.randn(3, 64).bfloat16()
    x[0, 5], x[1, 40] = float("inf"), float("nan")
    y = bf16_kernels().int8x_gemv(x, tiles)  # type: ignore[union-attr]
    assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())


@native
@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
def test_int8x_takes_a_group_below_2_to_the_minus_90_as_zero() -> None:
    """A group of x whose largest value is below 2^-90 (subnormal scales,
    slow on x86) contributes nothing; one at 2^-90 as ever, and a row's
    other groups too."""
    blocks = Int4Blocks(torch.randint(0, 16, (16, 64), dtype=torch.uint8),
                        torch.full((16, 2), 0.01), torch.full((16, 2), -0.08), 32)
    tiles = quant.int8x_stream(blocks)
    x = torch.randn(3, 64)
    x[:2, 32:] = 0.0
    x[0, :32] *= 2.0**-100  # below: nothing
    x[1, :32] = x[1, :32] / x[1, :32].abs().max() * 2.0**-90  # at the floor: counted
    x[2, :32] *= 2.0**-100  # below, beside a group of normal values
    x = x.bfloat16()
    y = bf16_kernels().int8x_gemv(x, tiles).float()  # type: ignore[union-attr]
    assert bool((y[0] == 0).all()) and bool((y[1] != 0).any())
    torch.testing.assert_close(y[2], (int8_x(x[2:]) @ blocks.dequantize().T)[0].bfloat16().float())
    assert torch.equal(y[2], bf16_kernels().int8x_gemv(  # type: ignore[union-attr]
        torch.cat([torch.zeros(1, 32), x[2:, 32:].float()], 1).bfloat16(), tiles)[0].float())


amx = pytest.mark.skipif(not quant.amx_int8(), reason="no AMX int8 tiles on this CPU")


@native
@amx
@pytest.mark.parametrize("inputs", [64, 96, 576])  # 2, 3 and 18 groups (odd and even)
def test_q8_products_on_amx_tiles_are_the_vpdpbusd_kernels_bits(inputs: int) -> None:
    """int8x_gemv's q8 products on AMX tiles (from 5 rows) give the
    vpdpbusd kernel's bits for every row count up to past two tiles of 16
    rows: the int32 sums are exact and the epilogue runs in the same order,
    so the head's choice of kernel by row count changes no token. A group
    that is not finite is NaN there too, and reading on into a next
    product's tiles changes nothing."""
    kernels = bf16_kernels()
    torch.manual_seed(5)
    q = torch.randint(-127, 128, (48, inputs), dtype=torch.int8)
    d = (torch.rand(48, inputs // 32) * 0.01).half().float()
    tiles = quant.q8_stream(q, d)
    weights = (q.float().view(48, -1, 32) * d[..., None]).view(48, inputs)
    for rows in (*range(1, 18), 24, 31, 32, 33, 40):
        x = torch.randn(rows, inputs).bfloat16()
        if rows == 7:
            x[2, 3], x[5, inputs - 1] = float("inf"), float("nan")
        on_tiles = kernels.int8x_gemv_on(x, tiles, "amx")  # type: ignore[union-attr]
        vnni = kernels.int8x_gemv_on(x, tiles, "vnni")  # type: ignore[union-attr]
        assert torch.equal(on_tiles.view(torch.int16), vnni.view(torch.int16)), rows
        chained = kernels.int8x_gemv(x, tiles, tiles[:1])  # type: ignore[union-attr]
        assert torch.equal(chained.view(torch.int16), vnni.view(torch.int16)), rows
        finite = on_tiles.float().isfinite().all(dim=1)
        expected = int8_x(x) @ weights.T
        error = (on_tiles.float() - expected)[finite].abs().max() / expected[finite].abs().max()
        assert error < 2**-7, (rows, float(error))
        if rows == 7:
            assert finite.tolist() == [True, True, False, True, True, False, True]


@native
@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("inputs", [64, 576])
def test_q8_tiles_on_vpdpbusd_give_each_row_the_same_bits_alone_and_in_a_batch(inputs: int) -> None:
    """q8 tiles (a GGUF's Q8_0 blocks, the q4 models' head) on the vpdpbusd
    kernel give int8(x) @ (d·q).T at every row count, through the counts
    where a row's sums go from two chains to one and past a pass of 8 rows,
    each row the same bits alone as in the batch."""
    kernels = bf16_kernels()
    torch.manual_seed(8)
    q = torch.randint(-127, 128, (48, inputs), dtype=torch.int8)
    q[0, :32], q[1, :32] = -127, 127  # the levels' extremes: the int32 sums' largest
    d = (torch.rand(48, inputs // 32) * 0.01).half().float()
    tiles = quant.q8_stream(q, d)
    weights = (q.float().view(48, -1, 32) * d[..., None]).view(48, inputs)
    x = torch.randn(33, inputs).bfloat16()
    for rows in (*range(1, 19), 24, 32, 33):
        batch = kernels.int8x_gemv_on(x[:rows], tiles, "vnni")  # type: ignore[union-attr]
        expected = int8_x(x[:rows]) @ weights.T
        assert float((batch.float() - expected).abs().max() / expected.abs().max()) < 2**-7, rows
        alone = torch.cat([kernels.int8x_gemv_on(x[r : r + 1], tiles, "vnni")  # type: ignore[union-attr]
                           for r in range(rows)])
        assert torch.equal(alone.view(torch.int16), batch.view(torch.int16)), rows


@native
@amx
def test_the_amx_kernel_refuses_q4_tiles_by_name() -> None:
    blocks = Int4Blocks(torch.randint(0, 16, (16, 64), dtype=torch.uint8),
                        torch.full((16, 2), 0.25), torch.full((16, 2), -2.0), 32)  # fp16's
    x = torch.randn(5, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"the AMX kernel takes q8 tiles \(544 bytes\), got 320"):
        bf16_kernels().int8x_gemv_on(x, quant.int8x_stream(blocks), "amx")  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"kernel must be 'vnni' or 'amx', got 'tiles'"):
        bf16_kernels().int8x_gemv_on(x, quant.int8x_stream(blocks), "tiles")  # type: ignore[union-attr]


@native
@amx
def test_the_q8_head_takes_up_to_16_rows_where_the_tiles_run_it() -> None:
    head = quant.Q8Head(torch.randint(-127, 128, (256, 128), dtype=torch.int8),
                        (torch.rand(256, 4) * 0.01).half().float())
    assert head.amx
    assert head.takes(torch.zeros(16, 128, dtype=torch.bfloat16))
    assert not head.takes(torch.zeros(17, 128, dtype=torch.bfloat16))


@native
@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("inputs", [32, 96, 640])  # Gemma 3 270M's width: 20 groups
def test_q5_tiles_multiply_q5_0_levels_as_their_exact_weights(inputs: int) -> None:
    """Levels in -16..15 (a GGUF's Q5_0 blocks) as q5 tiles, 352 bytes per
    16 outputs and 32 inputs (5.5 bits a weight, as the file stores them,
    where q8 tiles take 8.5): int8x_gemv gives int8(x) @ (d·q).T for every
    row count, each row the same bits alone as in any batch, reading on into
    a next product's tiles changes nothing, a group that is not finite
    gives NaN, and Q8Linear's tiles read back to the weights exactly."""
    kernels = bf16_kernels()
    torch.manual_seed(7)
    q = torch.randint(-16, 16, (48, inputs), dtype=torch.int8)
    q[0, :32] = -16  # every level's extremes, every fifth bit set and clear
    q[1, :32] = 15
    d = (torch.randn(48, inputs // 32) * 0.01).half().float()
    tiles = quant.q5_stream(q, d)
    assert tiles.shape == (3, inputs // 32, 352)
    weights = (q.float().view(48, -1, 32) * d[..., None]).view(48, inputs)
    x = torch.randn(19, inputs).bfloat16()
    x[7, 3] = float("inf")
    batch = kernels.int8x_gemv(x, tiles)  # type: ignore[union-attr]
    finite = batch.float().isfinite().all(dim=1)
    assert finite.tolist() == [r != 7 for r in range(19)]
    expected = int8_x(x) @ weights.T
    error = (batch.float() - expected)[finite].abs().max() / expected[finite].abs().max()
    assert error < 2**-7, float(error)
    for rows in range(1, 19):
        alone = kernels.int8x_gemv(x[rows - 1 : rows], tiles)  # type: ignore[union-attr]
        assert torch.equal(alone.view(torch.int16), batch[rows - 1 : rows].view(torch.int16)), rows
        first = kernels.int8x_gemv(x[:rows], tiles, tiles[:1])  # type: ignore[union-attr]
        assert torch.equal(first.view(torch.int16), batch[:rows].view(torch.int16)), rows
    linear = quant.Q8Linear(q, d)  # q5 tiles where the CPU has no AMX
    assert torch.equal(linear.tiles, tiles) is linear.q5
    assert torch.equal(linear.dequantize(), weights)


def test_q8_linear_takes_q5_tiles_only_for_levels_they_hold_and_without_amx() -> None:
    """Q5_0's levels go to q5 tiles where the CPU has no AMX (whose tiles
    take q8 ones from 5 rows); a Q8_0 tensor's always to q8 tiles; a level
    outside -16..15 is refused by the q5 layout, by name."""
    from specpage.kernels.cpu import features as cpu

    d = torch.full((16, 1), 0.01).half().float()
    q5_levels = torch.randint(-16, 16, (16, 32), dtype=torch.int8)
    q8_levels = q5_levels.clone()
    q8_levels[0, 0] = 16
    assert quant.Q8Linear(q5_levels, d).q5 is not cpu.has_amx()
    assert not quant.Q8Linear(q8_levels, d).q5
    assert quant.Q8Linear(q8_levels, d).tiles.shape[-1] == 544
    with pytest.raises(ValueError, match=r"q5 tiles hold levels in -16\.\.15"):
        quant.q5_stream(q8_levels, d)


@native
@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
def test_q8_linear_is_its_levels_times_d_on_int8_inputs() -> None:
    """Q8Linear (a GGUF's Q8_0 or Q5_0 blocks) computes int8(x) @ (d·q).T
    plus its bias for any number of rows, each row the same bits alone as
    in a batch, in the model's dtype, and offers the native layer stack its
    kernel only without a bias."""
    torch.manual_seed(6)
    q = torch.randint(-16, 16, (64, 96), dtype=torch.int8)  # Q5_0's levels
    d = (torch.randn(64, 3) * 0.01).half().float()  # signed, as Q5_0's are
    bias = torch.randn(64).bfloat16()  # in the model's dtype, as loading casts it
    linear = quant.Q8Linear(q, d, bias)
    weights = (q.float().view(64, -1, 32) * d[..., None]).view(64, 96)
    x = torch.randn(41, 96).bfloat16()
    y = linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (41, 64)
    expected = int8_x(x) @ weights.T + bias.float()
    assert float((y.float() - expected).abs().max() / expected.abs().max()) < 2**-7
    for rows in (1, 5, 17):
        alone = linear(x[:rows])
        assert torch.equal(alone.view(torch.int16), y[:rows].view(torch.int16)), rows
    assert linear(x.float()).dtype == torch.float32
    assert torch.equal(linear.dequantize(), weights)
    assert linear.direct_product(1) is None
    assert quant.Q8Linear(q, d).direct_product(1) is not None


@native
@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("tiles_of", ["q4 half", "q4 float", "q8", "q5"])
def test_widened_products_are_the_bf16_products_as_fp32(tiles_of: str) -> None:
    """int8x_gemv_widened (a quantized head's logits, as sampling reads
    them) holds exactly int8x_gemv(...).float() at every row count, on the
    AMX tiles too where the CPU has them, a group that is not finite
    included."""
    kernels = bf16_kernels()
    torch.manual_seed(13)
    inputs = 96
    if tiles_of.startswith("q4"):
        blocks = Int4Blocks(torch.randint(0, 16, (48, inputs), dtype=torch.uint8),
                            (torch.rand(48, 3) * 0.01).half().float(),
                            (torch.rand(48, 3) * -0.08).half().float(), 32)
        tiles = quant.int8x_stream(blocks, half=tiles_of == "q4 half")
    else:
        levels = (-127, 128) if tiles_of == "q8" else (-16, 16)
        q = torch.randint(*levels, (48, inputs), dtype=torch.int8)
        d = (torch.rand(48, inputs // 32) * 0.01).half().float()
        tiles = quant.q8_stream(q, d) if tiles_of == "q8" else quant.q5_stream(q, d)
    for rows in (1, 2, 3, 5, 8, 9, 17):
        x = torch.randn(rows, inputs).bfloat16()
        if rows == 5:
            x[1, 3] = float("inf")
        widened = kernels.int8x_gemv_widened(x, tiles)  # type: ignore[union-attr]
        assert widened.dtype == torch.float32 and widened.shape == (rows, 48)
        expected = kernels.int8x_gemv(x, tiles).float()  # type: ignore[union-attr]
        assert torch.equal(widened.view(torch.int32), expected.view(torch.int32)), rows
