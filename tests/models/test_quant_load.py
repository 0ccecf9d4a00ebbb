"""Quantizing a loaded model (specpage/models/quant_load.py): a GGUF's own
Q4_0/Q4_1 blocks, round-to-nearest from float weights, the Q8_0 vocabulary
projection, and the settings that choose them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specpage.config import ConfigError, ModelSection
from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig
from specpage.layers import quant
from specpage.layers.products import bf16_kernels
from specpage.layers.quant import (
    DENSE_FROM_ROWS,
    INT8X_DENSE_FROM_ROWS,
    Int4Linear,
    keeps_dense_copy,
)
from specpage.llm import LLM
from specpage.models.gguf_blocks import GGUF_PARTS, GGUFWeights
from specpage.models.loader import LoadedModel, load_model
from specpage.models.quant_load import PROJECTIONS, quantize_rtn
from specpage.models.quant_names import QuantizationError
from tests.layers.test_quant import both_products, int8_x, native
from tests.support.checkpoints import self_drafted, tiny_checkpoint
from tests.support.gguf_files import byte_level_alphabet

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
# what a q4 model's quantization string ends with where the int4 products
# take x to int8 (a CPU with AVX-512 VNNI)
INT8X = ", int8 product inputs" if quant.int8x_kernels() else ""


def write_gguf(path: Path, linear_type: str, seed: int = 0, vocab_multiple: int = 1) -> Path:
    """A tiny random Llama laid out like SmolLM2's GGUF: Q8_0 tied
    embedding, F32 norms, every linear in ``linear_type``; the vocabulary
    padded with unused tokens to a multiple of ``vocab_multiple``."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_level_alphabet(), "he"]
    tokens += [f"<unused{i}>" for i in range(-len(tokens) % vocab_multiple)]
    vocab, kv = len(tokens), HIDDEN // HEADS * KV_HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (vocab - 3))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def add(name: str, shape: tuple[int, int], qtype: gguf.GGMLQuantizationType) -> None:
        weight = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    linear = gguf.GGMLQuantizationType[linear_type]
    add("token_embd.weight", (vocab, HIDDEN), gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)),
                            ("attn_v", (kv, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))):
            add(p + name + ".weight", shape, linear)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("quant")
    files = {kind: write_gguf(folder / f"tiny.{kind}.gguf", kind)
             for kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_1")}
    # a vocabulary in whole blocks of 16: the head runs on its Q8_0 blocks (Q8Head)
    files["Q4_1 vocab 272"] = write_gguf(folder / "tiny.Q4_1.v272.gguf", "Q4_1", vocab_multiple=16)
    return files


def loaded(path: Path, quantization: str | None = None, dtype: str | None = None) -> LoadedModel:
    model = load_model(path, dtype, quantization=quantization)
    assert isinstance(model, LoadedModel)
    return model


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_auto_runs_the_gguf_blocks_which_dequantize_to_the_fp32_weights(
    ggufs: dict[str, Path], kind: str
) -> None:
    dense = loaded(ggufs[kind])
    quantized = loaded(ggufs[kind], "auto")
    assert quantized.quantization == f"q4 from GGUF {kind} blocks, bf16 activations{INT8X}"
    assert dense.quantization == "none"
    assert quantized.identity != dense.identity  # their KV differ: keep prefix caches apart
    weights = GGUFWeights(ggufs[kind], dense.config)
    for i in range(LAYERS):
        for name in PROJECTIONS:
            module = getattr(quantized.model.layers[i], name)
            assert isinstance(module, Int4Linear)
            assert module.group_size == 32
            # Bit for bit: q/k rows un-permuted and fused in the fp32 path's order.
            fp32 = getattr(dense.model.layers[i], name).weight
            assert torch.equal(weights.blocks(i, name).dequantize(), fp32), (i, name)
    assert not any(isinstance(m, Int4Linear) for m in dense.model.modules())


def test_a_quantized_model_computes_in_bf16_unless_a_dtype_is_chosen(
    ggufs: dict[str, Path]
) -> None:
    default = loaded(ggufs["Q4_1"], "q4")
    assert default.model.embed_tokens.weight.dtype == torch.bfloat16  # the runner's KV dtype
    assert default.model.norm.weight.dtype == torch.bfloat16
    assert default.model.inv_freq.dtype == torch.float32
    chosen = loaded(ggufs["Q4_1"], "q4", "fp32")
    assert chosen.quantization == "q4 from GGUF Q4_1 blocks"
    assert chosen.model.embed_tokens.weight.dtype == torch.float32
    # fp32 asks for precision: the products keep x in bf16, not int8
    assert isinstance(chosen.model.layers[0].qkv_proj, Int4Linear)
    assert not any(isinstance(m, Int4Linear) and m.int8x for m in chosen.model.modules())
    assert all(m.int8x == bool(INT8X) for m in default.model.modules()
               if isinstance(m, Int4Linear))
    assert loaded(ggufs["Q4_1"]).model.embed_tokens.weight.dtype == torch.float32


def test_one_int4_linear_matches_the_fp32_linear_within_bf16(ggufs: dict[str, Path]) -> None:
    dense = loaded(ggufs["Q4_1"])
    quantized = loaded(ggufs["Q4_1"], "q4")
    torch.manual_seed(0)
    for name in PROJECTIONS:
        reference, module = (getattr(m.model.layers[1], name) for m in (dense, quantized))
        x = torch.randn(5, reference.in_features)
        expected, actual = reference(x), module(x)
        assert actual.dtype == torch.float32 and actual.shape == expected.shape
        # bf16 activations, scales and output: 8 significant bits, so within a
        # few parts in 256 of the output's size.
        error = (actual - expected).abs().max() / expected.abs().max()
        assert error < 2**-6, (name, float(error))


def test_a_ggufs_q8_0_blocks_are_read_as_the_fp32_weights_hold_them(
        ggufs: dict[str, Path]) -> None:
    """The token embedding's Q8_0 blocks read from the file: d·q is the
    embedding the loader dequantized, bit for bit; another type reads as None."""
    path = ggufs["Q4_1 vocab 272"]
    model = loaded(path)
    blocks = GGUFWeights(path, model.config).q8_0("token_embd.weight")
    assert blocks is not None
    q, d = blocks
    weight = model.model.embed_tokens.weight.detach()
    assert q.dtype == torch.int8 and q.shape == weight.shape and d.shape == (272, HIDDEN // 32)
    assert torch.equal((d[..., None] * q.float().view(*d.shape, 32)).view_as(weight), weight)
    assert GGUFWeights(path, model.config).q8_0("blk.0.attn_q.weight") is None


@native
@both_products
def test_the_q8_head_computes_the_vocabulary_projection_on_its_exact_weights(
        ggufs: dict[str, Path], int8x: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A q4 load of a GGUF whose tied embedding is Q8_0 (and whose vocabulary
    is in blocks of 16) projects a few rows on those blocks: within bf16 of
    the fp32 weights' product (of x as int8x takes it, where it does) for 1-8
    rows, a row's logits the same bits alone or among others; on int8x
    products without AMX the same for every row count, else past 8 rows (16
    where its products run on AMX tiles) the dense head, and in fp32."""
    monkeypatch.setattr(quant, "INT8X_PRODUCTS", int8x)
    path = ggufs["Q4_1 vocab 272"]
    weight = loaded(path).model.embed_tokens.weight.detach()
    model = loaded(path, "q4")
    assert loaded(path, "q4", "bf16").model.q8_head is not None  # bf16 chosen, as serve does
    assert model.quantization == ("q4 from GGUF Q4_1 blocks, Q8_0 vocabulary projection, "
                                  "bf16 activations" + (", int8 product inputs" if int8x else ""))
    head = model.model.q8_head
    assert isinstance(head, quant.Q8Head) and head.int8x == int8x
    assert head.tiles.shape[2] == (544 if int8x else 320)
    torch.manual_seed(0)
    every_count = head.int8x and not head.amx
    x = torch.randn(40, HIDDEN).bfloat16()
    expected = (int8_x(x) if int8x else x).double() @ weight.double().T
    for rows in (*range(1, 9), *((12, 40) if every_count else ())):
        assert head.takes(x[:rows])
        actual = head(x[:rows]).double()
        error = (actual - expected[:rows]).abs().max() / expected[:rows].abs().max()
        assert error < 2**-7, (rows, float(error))
        assert torch.equal(head(x[rows - 1 : rows]), head(x[:rows])[rows - 1 :])
    if not every_count:
        limit = quant.Q8_HEAD_AMX_MAX_ROWS if head.amx else quant.Q8_HEAD_MAX_ROWS
        assert head.takes(torch.zeros(limit, HIDDEN, dtype=torch.bfloat16))
        assert not head.takes(torch.zeros(limit + 1, HIDDEN, dtype=torch.bfloat16))
    assert not head.takes(x.float())
    assert loaded(path, "q4", "fp32").model.q8_head is None  # fp32 activations: dense
    assert loaded(path).model.q8_head is None  # no quantization: the exact dense head


@pytest.mark.skipif(bf16_kernels() is None, reason="no native int4 kernel on this CPU")
def test_speculation_on_the_q8_head_equals_decoding_on_it(
        ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify step's rows and the decode step's take the same Q8Head
    and int4 kernels (held below their dense thresholds): a self-drafting q4
    target's greedy tokens are those of the target alone."""
    monkeypatch.setattr(quant, "DENSE_FROM_ROWS", 10**9)
    monkeypatch.setattr(quant, "INT8X_DENSE_FROM_ROWS", 10**9)
    monkeypatch.setattr(quant, "Q8_HEAD_MAX_ROWS", 10**9)
    plain, spec, (alone, drafted) = self_drafted(ggufs["Q4_1 vocab 272"], "q4", 24)
    assert plain.target.model.q8_head is not None and spec.target.model.q8_head is not None
    assert spec.draft is not None and spec.draft.model.q8_head is not None
    assert drafted == alone


@pytest.mark.skipif(not keeps_dense_copy(), reason="no native bf16 products on this CPU")
def test_many_rows_take_the_dense_copy_of_the_kernels_own_weights(
        ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """On the bf16 products, from DENSE_FROM_ROWS rows a product runs on the
    dense bf16 copy: the kernel's weights (q - 8) * scale + zero,
    dequantized; its results agree with the int4 kernel's within bf16, below
    and above the threshold. On int8x products a layer keeps one only where
    oneDNN runs bf16 on AMX, taken from INT8X_DENSE_FROM_ROWS rows."""
    if quant.int8x_kernels():
        int8x = loaded(ggufs["Q4_1"], "q4")
        kept = [m for m in int8x.model.modules()
                if isinstance(m, Int4Linear) and m.dense is not None]
        if not keeps_dense_copy(int8x=True):
            assert not kept
        for module in kept:
            for rows in (INT8X_DENSE_FROM_ROWS - 1, INT8X_DENSE_FROM_ROWS):
                x = torch.randn(rows, module.in_features, dtype=torch.bfloat16)
                int8x_y, dense = module.int4_product(x).float(), module.dense_product(x).float()
                assert float((int8x_y - dense).abs().max() / int8x_y.abs().max()) < 2**-5
                chosen = module(x).float()
                assert torch.equal(chosen, dense if rows >= INT8X_DENSE_FROM_ROWS else int8x_y)
    monkeypatch.setattr(quant, "INT8X_PRODUCTS", False)
    quantized = loaded(ggufs["Q4_1"], "q4")
    torch.manual_seed(1)
    for name in PROJECTIONS:
        module = getattr(quantized.model.layers[0], name)
        assert module.dense is not None
        eye = torch.eye(module.in_features, dtype=torch.bfloat16)
        kernel_weights = module.int4_product(eye).T.float()  # column j: W @ e_j
        assert torch.allclose(module.dense.float(), kernel_weights, rtol=2**-7, atol=1e-6)
        for rows in (DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS, 32):
            x = torch.randn(rows, module.in_features, dtype=torch.bfloat16)
            int4, dense = module.int4_product(x).float(), module.dense_product(x).float()
            assert float((int4 - dense).abs().max() / int4.abs().max()) < 2**-6
            chosen = module(x).float()
            assert torch.equal(chosen, dense if rows >= DENSE_FROM_ROWS else int4)


def test_q4_from_float_weights_rounds_to_nearest_and_is_cached(tmp_path: Path) -> None:
    tiny_checkpoint(tmp_path / "hf", num_hidden_layers=1)
    dense = loaded(tmp_path / "hf")
    first = loaded(tmp_path / "hf", "q4")
    assert first.quantization == f"q4 g32 round-to-nearest, bf16 activations{INT8X}"
    cached = list((Path(__import__("os").environ["SPECPAGE_CACHE_DIR"]) / "quantized").glob(
        f"{dense.identity.hex()[:32]}-q4-g32-*.safetensors"))
    assert len(cached) == 1
    again = loaded(tmp_path / "hf", "q4")  # from the cache file
    for name in PROJECTIONS:
        a, b = (getattr(m.model.layers[0], name) for m in (first, again))
        x = torch.randn(3, a.in_features, dtype=torch.bfloat16)
        assert torch.equal(a.int4_product(x), b.int4_product(x))
    weight = dense.model.layers[0].gate_up_proj.weight
    blocks = quantize_rtn(weight, 64)
    step = blocks.scale.repeat_interleave(64, dim=1)
    assert torch.all((blocks.dequantize() - weight).abs() <= step / 2 + 1e-6)
    assert int(blocks.q.min()) == 0 and int(blocks.q.max()) == 15


def test_q4_target_and_draft_speculating_equal_q4_without_speculation(
    ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation adds nothing of its own: with one kernel for every product
    the tokens are those of the target alone. (The dense copy that many-row
    products take rounds differently from the int4 kernel, and verification
    brings more rows than decoding, so it is kept out of the comparison.)"""
    monkeypatch.setattr(quant, "DENSE_FROM_ROWS", 10**9)
    monkeypatch.setattr(quant, "INT8X_DENSE_FROM_ROWS", 10**9)
    draft = write_gguf(tmp_path / "draft.Q4_0.gguf", "Q4_0", seed=1)
    prompts = [[40, 41, 42, 43, 44], [50, 60, 70], [100, 101, 102, 103, 104, 105, 106]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(ggufs["Q4_1"], None, EngineConfig(spec_k=0, adaptive_k=False, num_blocks=64),
                quantization="q4")
    spec = LLM(ggufs["Q4_1"], draft, EngineConfig(spec_k=3, adaptive_k=False, num_blocks=64),
               quantization="q4")
    assert spec.draft is not None
    assert spec.draft.quantization == f"q4 from GGUF Q4_0 blocks, bf16 activations{INT8X}"
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    actual = [c.token_ids for c in spec.generate(prompts, params)]
    assert actual == expected
    assert all(len(tokens) == 24 for tokens in expected)


def test_a_draft_computes_in_its_targets_dtype_unless_one_is_chosen(
        ggufs: dict[str, Path], tmp_path: Path) -> None:
    """auto leaves a float draft unquantized; it loads in its q4 target's
    bf16, not the loader's fp32, unless a dtype is asked for."""
    draft = write_gguf(tmp_path / "draft.F32.gguf", "F32", seed=1)
    config = EngineConfig(spec_k=2, adaptive_k=False, num_blocks=64)
    llm = LLM(ggufs["Q4_1"], draft, config, quantization="auto")
    assert llm.target.model.embed_tokens.weight.dtype == torch.bfloat16
    assert llm.draft is not None and llm.draft.quantization == "none"
    assert llm.draft.model.embed_tokens.weight.dtype == torch.bfloat16
    chosen = LLM(ggufs["Q4_1"], draft, config, dtype="fp32", quantization="auto")
    assert chosen.draft is not None
    assert chosen.draft.model.embed_tokens.weight.dtype == torch.float32


def test_unknown_quantization_names_it() -> None:
    with pytest.raises(QuantizationError, match="unknown quantization 'q5'.*none, q4"):
        load_model("no-such-folder", quantization="q5")
    with pytest.raises(ConfigError, match="model.quantization must be one of.*got 'int4'"):
        ModelSection(quantization="int4")
    assert ModelSection(quantization="auto").quantization == "auto"


def test_q8_is_refused_saying_why() -> None:
    with pytest.raises(QuantizationError, match="q8 is not offered.*slower than q4"):
        load_model("no-such-folder", quantization="q8")
    with pytest.raises(ConfigError, match="q8 is not offered"):
        ModelSection(quantization="q8")


def test_unsupported_gguf_type_names_it(ggufs: dict[str, Path]) -> None:
    with pytest.raises(QuantizationError, match=r"linears are Q5_1 \(Q5_1 unsupported\)"):
        load_model(ggufs["Q5_1"], quantization="q4")
    # auto leaves a GGUF it cannot reuse as loaded
    assert loaded(ggufs["Q5_1"], "auto").quantization == "none"
    weights = GGUFWeights(ggufs["Q5_1"], loaded(ggufs["Q5_1"]).config)
    with pytest.raises(QuantizationError, match="blk.0.attn_q.weight is Q5_1"):
        weights.blocks(0, "qkv_proj")
    assert GGUF_PARTS["qkv_proj"] == ("attn_q", "attn_k", "attn_v")


@pytest.mark.skipif(not quant.int8x_kernels(), reason="int8 products need AVX-512 VNNI")
def test_a_q8_0_gguf_runs_on_its_int8_levels(ggufs: dict[str, Path]) -> None:
    """Every linear Q8_0: auto runs each on its blocks (Q8Linear), which hold
    the fp32 path's weights bit for bit (q/k rows un-permuted, fused in its
    order); tests/layers/test_quant.py checks Q8Linear's products."""
    dense, quantized = loaded(ggufs["Q8_0"]), loaded(ggufs["Q8_0"], "auto")
    assert quantized.quantization == "GGUF Q8_0 blocks, bf16 activations, int8 product inputs"
    for i in range(LAYERS):
        for name in PROJECTIONS:
            module = getattr(quantized.model.layers[i], name)
            assert isinstance(module, quant.Q8Linear)
            fp32 = getattr(dense.model.layers[i], name).weight
            assert torch.equal(module.dequantize(), fp32), (i, name)


def test_q4_on_inputs_not_a_multiple_of_the_group_says_so(
    ggufs: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(QuantizationError, match="multiple of the group size 32; this weight "
                                                "has 48 inputs"):
        quantize_rtn(torch.randn(8, 48), 32, "w")
    tiny_checkpoint(tmp_path / "hf", num_hidden_layers=1)  # hidden 64
    with pytest.raises(QuantizationError, match="layers.0.qkv_proj: q4 needs in_features a "
                                                "multiple of the group size 128; this weight "
                                                "has 64 inputs"):
        load_model(tmp_path / "hf", quantization="q4-g128")
    with pytest.raises(QuantizationError, match="groups of 32; q4-g64 would re-quantize"):
        load_model(ggufs["Q4_1"], quantization="q4-g64")


def test_a_daemon_with_quantization_q4_streams_what_the_in_process_q4_engine_does(
    tmp_path: Path,
) -> None:
    import asyncio

    from specpage.client import Client
    from tests.support.daemon import Daemon, tiny_pair

    greedy = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    prompts = [[5, 17, 33, 8, 90], [120, 3, 44]]
    # bf16 activations, as in process (the test daemons default to fp32)
    daemon = Daemon(tmp_path, env={"SPECPAGE_MODEL_QUANTIZATION": "q4",
                                   "SPECPAGE_MODEL_DTYPE": "bfloat16"})
    try:
        target, draft = tiny_pair(tmp_path / "models")
        local = LLM(target, draft, EngineConfig(block_size=4, num_blocks=512, spec_k=3),
                    quantization="q4")
        assert local.target.quantization == f"q4 g32 round-to-nearest, bf16 activations{INT8X}"
        expected = [c.token_ids for c in local.generate(prompts, SamplingParams(**greedy))]
        fp32 = LLM(target, draft, EngineConfig(block_size=4, num_blocks=512, spec_k=3))
        # Differs from fp32, so equal streams show the setting reached the daemon.
        assert [c.token_ids for c in fp32.generate(prompts, SamplingParams(**greedy))] != expected
        daemon.wait_serving()

        async def remote() -> list[list[int]]:
            async with Client(daemon.address) as client:
                return [(await client.complete(p, **greedy)).token_ids for p in prompts]

        assert asyncio.run(remote()) == expected
    finally:
        assert daemon.stop() == 0


def test_tensor_parallel_refuses_a_quantized_target(ggufs: dict[str, Path]) -> None:
    with pytest.raises(QuantizationError, match="tensor_parallel_size 2 shards dense weights "
                                                "only; the target is quantized"):
        LLM(ggufs["Q4_1"], None, EngineConfig(tensor_parallel_size=2), quantization="q4")
