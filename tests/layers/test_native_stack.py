"""The decoder's layers in one native call (specpage/layers/native_stack.py,
kernels/cpu/decoder_stack.cpp) give exactly what the module path gives:
the same logits, the same K/V in the cache and the same tapped hidden
states, for decode and verify steps in bf16 and q4 (on the native products
and on oneDNN's); and forwards it does not
take (a prefill chunk, fp32) run the module path."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from specpage.attention.cpu import NATIVE_SPAN
from specpage.core.layer_groups import layer_groups
from specpage.core.span import Span
from specpage.executor.model_runner import ModelRunner
from specpage.kernels.cpu import features as cpu
from specpage.layers import native_stack, quant
from specpage.layers.products import bf16_kernels
from specpage.layers.quant import DENSE_FROM_ROWS, INT8X_DENSE_FROM_ROWS, keeps_dense_copy
from specpage.models.decoder import LayerTap
from specpage.models.loader import load_model
from tests.support.checkpoints import family_checkpoint, tiny_checkpoint

pytestmark = pytest.mark.skipif(bf16_kernels() is None,
                                reason="no AVX-512 BF16 kernel in this build")

BLOCK = 16
# Widths the kernels take: hidden and intermediate whole vectors, products
# whole blocks of 16 outputs by 64 inputs, head_dim 64.
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stack")
    tiny_checkpoint(folder, seed=3, **SHAPE)
    return folder


# q4 with x taken to int8 at the products where the CPU can (the default),
# and q4 on the bf16 products
QUANTIZATIONS = [None, "q4", "q4 bf16 products"]


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 (q/k norms), its last two layers sliding with a window of 16,
    shorter than the prompts."""
    folder = tmp_path_factory.mktemp("qwen3")
    family_checkpoint(folder, "qwen3", seed=3, head_dim=64, use_sliding_window=True,
                      sliding_window=16, max_window_layers=1, **SHAPE)
    return folder


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3: four norms a layer scaling by (1 + weight), q/k norms, GeGLU,
    its sliding layers (a window of 16) on a rotary of their own and the
    seventh layer global, an attention scale other than head_dim's."""
    folder = tmp_path_factory.mktemp("gemma3")
    family_checkpoint(folder, "gemma3", seed=3, head_dim=64, sliding_window=16,
                      num_hidden_layers=7, **{k: v for k, v in SHAPE.items()
                                              if k != "num_hidden_layers"})
    return folder


def prefilled(checkpoint: Path, quantization: str | None, prompts: int) -> ModelRunner:
    int8x = quant.INT8X_PRODUCTS
    quant.INT8X_PRODUCTS = quantization != "q4 bf16 products"
    try:
        loaded = load_model(checkpoint, "bf16",
                            quantization=quantization and quantization.split()[0])
    finally:
        quant.INT8X_PRODUCTS = int8x
    runner = ModelRunner(loaded, 8 * prompts + 8, BLOCK)
    with torch.inference_mode():
        runner.forward([Span([(11 * s + 3 * j) % 500 + 1 for j in range(40)], 0,
                                table(s), 1) for s in range(prompts)])
    return runner


def table(seq: int) -> list[int]:
    return list(range(8 * seq, 8 * seq + 8))


def spans_of(shape: str) -> list[Span]:
    """A step's spans after prompts of 40 tokens (`prefilled`), by name."""
    return {
        "decode 1": [Span([7], 40, table(0))],
        "decode 3": [Span([7 + s], 40, table(s)) for s in range(3)],
        "verify 5": [Span([9, 8, 7, 6, 5], 40, table(1), 5)],
        "verify 2 + decode 2": [Span([9, 8], 40, table(0), 2), Span([5], 40, table(1)),
                                Span([4], 40, table(2))],
        "decode 20": [Span([7 + s], 40, table(s)) for s in range(20)],  # panels (oneDNN on AMX)
        "decode 66": [Span([7 + s], 40, table(s)) for s in range(66)],  # oneDNN
    }[shape]


def both_ways(runner: ModelRunner, spans: list[Span], monkeypatch: pytest.MonkeyPatch,
              layers: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(logits, the cache after, tapped states) by the direct loop and by the modules,
    each from the same cache."""
    before = runner.kv.tensor.clone()
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(native_stack, "ENABLED", enabled)
        runner.kv.tensor.copy_(before)
        tap = LayerTap(layers)
        logits = runner.forward(spans, tap)
        results.append((logits, runner.kv.tensor.clone(), torch.stack(tap.states)
                        if tap.states else torch.empty(0)))
    direct, modules = results
    return list(direct), list(modules)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("shape", ["decode 1", "decode 3", "verify 5", "verify 2 + decode 2",
                                   "decode 20", "decode 66"])
def test_the_direct_loop_gives_the_modules_logits_and_kv(
        checkpoint: Path, quantization: str | None, shape: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = int(shape.split()[-1]) if shape.startswith("decode") else 3
    runner = prefilled(checkpoint, quantization, max(prompts, 3))
    spans = spans_of(shape)
    rows = sum(len(s.token_ids) for s in spans)
    plan = runner.model.stack_plan(rows)
    assert plan is not None  # the native call applies to these rows
    expected = {1: native_stack.GEMV, 3: native_stack.GEMV, 5: native_stack.GEMV,
                4: native_stack.GEMV, 66: native_stack.ONEDNN,
                20: native_stack.ONEDNN if cpu.has_amx() else native_stack.PANELS}[rows]
    if quantization is None or (quantization == "q4 bf16 products" and rows >= DENSE_FROM_ROWS):
        assert plan.kinds[0] == expected
    elif quantization == "q4" and quant.int8x_kernels():
        dense = keeps_dense_copy(int8x=True) and rows >= INT8X_DENSE_FROM_ROWS
        assert plan.kinds[0] == (expected if dense else native_stack.INT8X)  # no dense copy
    (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(cache, ref_cache)
    assert not torch.equal(cache, runner.kv.tensor.new_zeros(()).expand_as(cache))


@pytest.mark.parametrize("shape", ["decode 3", "verify 5", "verify 2 + decode 2"])
def test_qwen3_layers_with_windows_give_the_modules_logits_and_kv(
        qwen3_checkpoint: Path, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = prefilled(qwen3_checkpoint, None, 3)
    assert runner.config.qk_norm and runner.config.windowed
    spans = spans_of(shape)
    plan = runner.model.stack_plan(sum(len(s.token_ids) for s in spans))
    assert plan is not None and plan.windows == [0, 16, 16] and len(plan.qk_norms) == 6
    (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(cache, ref_cache)
    # the window matters: the modules' logits without it differ
    monkeypatch.setattr(runner.model.layers[2], "window", None)
    assert not torch.equal(both_ways(runner, spans, monkeypatch)[1][0], logits)


@pytest.mark.parametrize("quantization", [None, "q4"])
@pytest.mark.parametrize("shape", ["decode 1", "decode 3", "verify 5", "verify 2 + decode 2"])
def test_gemma3_layers_give_the_modules_logits_and_kv(
        gemma3_checkpoint: Path, quantization: str | None, shape: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = prefilled(gemma3_checkpoint, quantization, 3)
    assert runner.native_step is not None  # the embedding, final norm and head around it too
    spans = spans_of(shape)
    plan = runner.model.stack_plan(sum(len(s.token_ids) for s in spans))
    assert plan is not None and plan.activation == native_stack.GELU_TANH
    assert len(plan.norms) == 4 * 7 and len(plan.qk_norms) == 2 * 7
    assert plan.windows == [16] * 5 + [0, 16] and plan.local_layers == [1] * 5 + [0, 1]
    assert plan.scale == 24**-0.5 and all(n.dtype == torch.float32 for n in plan.norms)
    (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("shape", ["decode 3", "verify 5", "verify 2 + decode 2"])
def test_layer_groups_tables_give_one_tables_logits(gemma3_checkpoint: Path, shape: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's KV in pages of a layer group each (core/layer_groups.py),
    each group's pages elsewhere in the pool: the native call (each layer
    through its group's slots and tables) gives the modules' logits and the
    logits of one table for every layer, and writes each layer's K/V into
    its group's pages."""
    loaded = load_model(gemma3_checkpoint, "bf16")
    c = loaded.config
    groups = layer_groups([c.window_of(i) or 0 for i in range(c.num_layers)])
    assert len(groups.windows) == 7  # one layer a page: 1 global, 6 sliding
    one = prefilled(gemma3_checkpoint, None, 3)
    per_group = 8 * 3 + 8
    runner = ModelRunner(loaded, per_group * 7, BLOCK, groups=groups)

    def grouped(spans: list[Span]) -> list[Span]:  # group g's blocks g * per_group onwards
        return [msgspec.structs.replace(s, group_tables=[
            [b + g * per_group for b in s.block_table] for g in range(1, 7)]) for s in spans]

    with torch.inference_mode():
        runner.forward(grouped([Span([(11 * s + 3 * j) % 500 + 1 for j in range(40)], 0,
                                     table(s), 1) for s in range(3)]))
    spans = grouped(spans_of(shape))
    (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
    assert torch.equal(logits, ref_logits) and torch.equal(cache, ref_cache)
    (one_logits, one_cache, _), _ = both_ways(one, spans_of(shape), monkeypatch)
    assert torch.equal(logits, one_logits)
    for layer in range(7):  # each layer's K/V in its group's pages, as one table holds it
        group, index = groups.place(layer)
        pages = cache[index, :, group * per_group:(group + 1) * per_group]
        assert torch.equal(pages, one_cache[layer, :, :per_group])


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_two_threads_reading_ahead_change_nothing(
        checkpoint: Path, quantization: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a second thread the norms, rotary embedding and SiLU of a step of
    few rows run while it reads the next products' weights ahead, and each
    int4 product reads on into the next: the same logits and KV."""
    runner = prefilled(checkpoint, quantization, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for spans in ([Span([7], 40, table(0))], [Span([9, 8, 7, 6, 5], 40, table(1), 5)]):
            (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
            assert torch.equal(logits, ref_logits)
            assert torch.equal(cache, ref_cache)
    finally:
        torch.set_num_threads(threads)


def test_q4_rows_take_the_int4_kernel_below_the_dense_copy(checkpoint: Path) -> None:
    """The native call chooses each product's kernel as Int4Linear.forward
    does: on the bf16 products, int4 below DENSE_FROM_ROWS rows and the
    dense copy from there; on int8x products, int8x at every row count where
    the layers keep no dense copy, else below INT8X_DENSE_FROM_ROWS."""
    bf16 = load_model(checkpoint, "bf16").model
    dense = bf16.stack_plan(DENSE_FROM_ROWS)
    assert dense is not None
    model = prefilled(checkpoint, "q4 bf16 products", 1).model
    few, many = model.stack_plan(DENSE_FROM_ROWS - 1), model.stack_plan(DENSE_FROM_ROWS)
    assert few is not None and many is not None
    assert few.kinds[0] == native_stack.INT4  # qkv of layer 0
    assert many.kinds[0] == dense.kinds[0] != native_stack.INT4
    if quant.int8x_kernels():
        model = prefilled(checkpoint, "q4", 1).model
        for rows in (1, DENSE_FROM_ROWS, INT8X_DENSE_FROM_ROWS, 200):
            plan = model.stack_plan(rows)
            assert plan is not None
            if keeps_dense_copy(int8x=True) and rows >= INT8X_DENSE_FROM_ROWS:
                assert plan.kinds[0] == bf16.stack_plan(rows).kinds[0]
            else:
                assert set(plan.kinds) == {native_stack.INT8X}


def test_the_tap_sees_the_same_states(checkpoint: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    runner = prefilled(checkpoint, None, 1)
    spans = [Span([9, 8, 7], 40, table(0), 3)]
    (_, _, states), (_, _, ref_states) = both_ways(runner, spans, monkeypatch, (0, 2, 2))
    assert states.shape == (3, 3, SHAPE["hidden_size"])
    assert torch.equal(states, ref_states)


def test_forwards_the_loop_does_not_take_run_the_modules(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk longer than the attention kernel's spans and an fp32
    model leave the loop before it does anything."""
    taken = []
    run_layers = native_stack.run_layers
    monkeypatch.setattr(native_stack, "run_layers",
                        lambda *a: taken.append(result := run_layers(*a)) or result)
    runner = prefilled(checkpoint, None, 2)
    runner.native_step = None  # which takes what it can before the module path
    runner.forward([Span(list(range(1, NATIVE_SPAN + 2)), 40, table(0))])
    assert taken[-1] is None
    runner.forward([Span([5], 40 + NATIVE_SPAN + 1, table(0))])
    assert taken[-1] is not None
    fp32 = ModelRunner(load_model(checkpoint, "fp32"), 32, BLOCK)
    fp32.forward([Span([5], 0, table(0))])
    assert taken[-1] is None


def test_the_native_call_refuses_operands_that_do_not_fit(checkpoint: Path) -> None:
    """A plan whose lists disagree with the layers is refused by name, with
    nothing written."""
    runner = prefilled(checkpoint, None, 1)
    plan = runner.model.stack_plan(1)
    assert plan is not None
    kernels = bf16_kernels()
    x = torch.zeros(1, SHAPE["hidden_size"], dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, 64, dtype=torch.bfloat16)
    index = torch.zeros(1, dtype=torch.int64)

    def call(**changes: object) -> None:
        args = dict(caches=list(runner.kv.layers), norms=plan.norms, kinds=plan.kinds,
                    outs=plan.outs, operands=plan.operands, taps=[], qk_norms=[],
                    windows=[], local_rope=[], local_layers=[], activation=0, group_slots=[],
                    group_tables=[], layer_groups=[]) | changes
        kernels.decoder_stack(x, cos, sin, args["caches"], index, index[None], torch.tensor(
            [0, 1]), torch.ones(1, dtype=torch.int64), args["norms"], args["kinds"],
            args["outs"], args["operands"], 2, 1, 1e-5, 0.125, args["taps"], args["qk_norms"],
            args["windows"], args["local_rope"], args["local_layers"], args["activation"],
            args["group_slots"], args["group_tables"], args["layer_groups"])

    before = runner.kv.tensor.clone()
    with pytest.raises(RuntimeError, match="norms and .* products"):
        call(kinds=plan.kinds[:-1], outs=plan.outs[:-1])
    with pytest.raises(RuntimeError, match="operands left over"):
        call(operands=plan.operands + plan.operands[:1])
    unknown = native_stack.KQUANT + native_stack.KQUANT_RUNS  # past the last K-quant kind
    with pytest.raises(RuntimeError, match=f"unknown product kind {unknown}"):
        call(kinds=[unknown] + plan.kinds[1:])
    with pytest.raises(RuntimeError, match=r"a K-quant product's runs must be int64 \[1, 3\]"):
        call(kinds=[native_stack.KQUANT] + plan.kinds[1:],
             operands=[torch.zeros(2, 2, dtype=torch.int64)] + plan.operands)
    with pytest.raises(RuntimeError, match="taps must name layers"):
        call(taps=[2, 0])
    with pytest.raises(RuntimeError, match="need 0 or 6 q/k norms"):
        call(qk_norms=plan.norms[:1])
    with pytest.raises(RuntimeError, match="need 0 or 3 windows"):
        call(windows=[0])
    with pytest.raises(RuntimeError, match="need 6 or 12 norms"):
        call(norms=plan.norms[:3])
    with pytest.raises(RuntimeError, match="local_rope must be none or"):
        call(local_rope=[cos, sin], local_layers=[1])
    with pytest.raises(RuntimeError, match="unknown activation 2"):
        call(activation=2)
    with pytest.raises(RuntimeError, match="must pair up, with a group per layer"):
        call(group_slots=[index], group_tables=[], layer_groups=[0, 1, 1])
    with pytest.raises(RuntimeError, match="layer group 2 has no slots and tables"):
        call(group_slots=[index], group_tables=[index[None]], layer_groups=[0, 2, 1])
    assert torch.equal(runner.kv.tensor, before)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 GGUF of Q4_K_M's mix (Q6_K v and down, Q4_K the rest: a qkv
    of two runs of one type each), widths whole super-blocks of 256."""
    from tests.models.test_gguf_file import TOKEN_IDS, k_quant_m
    from tests.support.gguf_files import write_gguf

    folder = tmp_path_factory.mktemp("kquant")
    model = family_checkpoint(folder / "hf", "qwen3", seed=3, hidden_size=256,
                              intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
                              **TOKEN_IDS)
    path = folder / "tiny-qwen3-k-m.gguf"
    write_gguf(model, path, k_quant_m)
    return path


@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("shape", ["decode 1", "decode 3", "verify 5", "verify 2 + decode 2"])
def test_k_quant_layers_give_the_modules_logits_and_kv(
        k_quant_gguf: Path, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """K-quant products in the native call (x to int8 once per projection,
    each run of one type into its columns) give the module path's bits."""
    from specpage.layers.kquant import KQuantLinear
    from tests.support.gguf_files import VOCAB_SIZE

    loaded = load_model(k_quant_gguf, "bf16", quantization="auto")
    assert isinstance(loaded.model.layers[0].qkv_proj, KQuantLinear)
    runner = ModelRunner(loaded, 8 * 3 + 8, BLOCK)
    with torch.inference_mode():
        runner.forward([Span([(11 * s + 3 * j) % (VOCAB_SIZE - 1) + 1 for j in range(40)], 0,
                             table(s), 1) for s in range(3)])
    spans = spans_of(shape)
    plan = runner.model.stack_plan(sum(len(s.token_ids) for s in spans))
    assert plan is not None
    # qkv: Q4_K then Q6_K (two runs); o, gate_up: one run; down: Q6_K
    assert plan.kinds[:4] == [native_stack.KQUANT + 1, native_stack.KQUANT,
                              native_stack.KQUANT, native_stack.KQUANT]
    (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(cache, ref_cache)
