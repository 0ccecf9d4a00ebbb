"""GGUF files read directly: the same model as the HF folder holding the
same values, its config as transformers reads it, no dense copy written."""

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from specpage.core.span import Span
from specpage.executor.model_runner import ModelRunner
from specpage.layers.kquant import KQuantHead, KQuantLinear, kquant_kernels
from specpage.layers.rope import inverse_frequencies
from specpage.models import gguf_file
from specpage.models.config import ModelConfig, ModelLoadError
from specpage.models.fetch import cache_dir
from specpage.models.gguf_dequant import SUPPORTED_TYPES
from specpage.models.gguf_file import GGUFFile
from specpage.models.loader import load_model
from tests.support.checkpoints import greedy_through_pool, self_drafted, tiny_checkpoint
from tests.support.gguf_files import CHAT_TEMPLATE, VOCAB_SIZE, write_gguf

Q = gguf.GGMLQuantizationType
# the tokenizer tests.support.gguf_files writes
TOKEN_IDS = {"vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def hf_and_gguf(tmp_path: Path, family: str, type_of=lambda name: Q.F32, **overrides):
    """(HF folder holding exactly what the GGUF holds, the GGUF's path)."""
    model = tiny_checkpoint(tmp_path / "written", family, **TOKEN_IDS, **overrides)
    path = tmp_path / f"tiny-{family}.gguf"
    held = write_gguf(model, path, type_of)
    model.load_state_dict(held, strict=False)  # a tied lm_head follows the embedding
    model.save_pretrained(tmp_path / "held")
    return tmp_path / "held", path


def assert_same_model(folder: Path, path: Path) -> None:
    ours, reference = load_model(path), load_model(folder)
    assert same_config(ours.config, reference.config)
    theirs = reference.model.state_dict()
    for name, tensor in ours.model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def same_config(ours: ModelConfig, reference: ModelConfig) -> bool:
    """Equal, the GGUF's float32 rms_norm_eps aside: the norm adds it to
    fp32 values, so only its float32 value counts."""
    eps = np.float32(ours.rms_norm_eps) == np.float32(reference.rms_norm_eps)
    return eps and dataclasses.replace(ours, rms_norm_eps=reference.rms_norm_eps) == reference


def converted() -> list[Path]:
    folder = cache_dir() / "gguf" / "converted"
    return sorted(folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_gguf_is_the_hf_model_and_writes_no_weights(tmp_path, family):
    before = converted()
    folder, path = hf_and_gguf(tmp_path, family)
    assert_same_model(folder, path)
    assert converted() == before
    loaded = load_model(path)
    assert not list(loaded.folder.glob("*.safetensors"))
    prompts = [[5, 80, 81, 7, 90], [100, 3]]
    tokens = [greedy_through_pool(ModelRunner(m, num_blocks=16, block_size=4), prompts,
                                  max_new=6, chunk=3, block_size=4)
              for m in (loaded, load_model(folder))]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_quantized_gguf_is_the_hf_model_of_its_dequantized_values(tmp_path, qtype):
    folder, path = hf_and_gguf(tmp_path, "llama", lambda name: qtype)
    assert GGUFFile(path).raw("blk.0.attn_q.weight").type_name == qtype.name
    assert_same_model(folder, path)


def test_tied_embedding_and_the_tokenizer_with_its_chat_template(tmp_path):
    folder, path = hf_and_gguf(tmp_path, "qwen2", tie_word_embeddings=True)
    loaded = load_model(path, quantization="none")
    assert loaded.config.tie_word_embeddings
    tokenizer = transformers.AutoTokenizer.from_pretrained(loaded.folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.model_max_length == 512
    assert json.loads((loaded.folder / "config.json").read_text()) == GGUFFile(path).config()
    # the folder loads the same model again, from the same GGUF
    again = load_model(loaded.folder)
    assert again.identity == loaded.identity
    assert torch.equal(again.model.embed_tokens.weight, loaded.model.embed_tokens.weight)


FAMILIES = {  # transformers' config and model classes, and the tiny config's extras
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 64}),
}


def write_family(tmp_path: Path, family: str) -> tuple[transformers.PreTrainedConfig, Path]:
    config_name, model_name, extras = FAMILIES[family]
    config = getattr(transformers, config_name)(
        **TOKEN_IDS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=family == "gemma3", **extras)
    config.architectures = [model_name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    path = tmp_path / f"{family}.gguf"
    write_gguf(model, path)
    return config, path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_dict_is_transformers_own(tmp_path, family):
    original, path = write_family(tmp_path, family)
    ours = GGUFFile(path).config()
    theirs = load_gguf_checkpoint(str(path))["config"]
    shared = theirs.keys() - {"_model_name_or_path"}
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    # and, where transformers fills in defaults, the config the file was written from
    rebuilt = type(original)(**ours).to_dict()
    expected = original.to_dict()
    for key in ours.keys() & expected.keys():
        if key == "rms_norm_eps":  # stored as float32
            assert np.float32(rebuilt[key]) == np.float32(expected[key])
        elif key not in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
            assert rebuilt[key] == expected[key], key
    assert rebuilt["rope_parameters"] == expected["rope_parameters"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_config_reads_the_dict(tmp_path, family):
    folder, path = hf_and_gguf(tmp_path, family)
    assert same_config(ModelConfig.from_dict(GGUFFile(path).config()),
                       ModelConfig.from_folder(folder))


def test_unsupported_tensor_type_names_tensor_type_and_supported(tmp_path):
    _, path = hf_and_gguf(tmp_path, "llama", lambda name: Q.Q4_0)
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_up.weight"
    # the type id follows the name, its dimension count and its 2 dimensions
    at = data.index(name) + len(name) + 4 + 16
    assert int.from_bytes(data[at:at + 4], "little") == Q.Q4_0
    data[at:at + 4] = int(Q.IQ4_NL).to_bytes(4, "little")  # same block size as Q4_0
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as error:
        load_model(path)
    message = str(error.value)
    assert "blk.1.ffn_up.weight is IQ4_NL" in message
    assert ", ".join(SUPPORTED_TYPES) in message


def test_projection_parts_are_the_stored_blocks_in_hf_row_order(tmp_path):
    _, path = hf_and_gguf(tmp_path, "llama", lambda name: Q.Q8_0)
    file = GGUFFile(path)
    parts = file.projection_parts(1, "qkv_proj")
    assert [(p.name, p.type_name, p.shape) for p in parts] == [
        ("blk.1.attn_q.weight", "Q8_0", (64, 64)),
        ("blk.1.attn_k.weight", "Q8_0", (32, 64)),
        ("blk.1.attn_v.weight", "Q8_0", (32, 64)),
    ]
    assert parts[0].data.shape == (64, 2 * 34)  # 2 blocks of 34 bytes a row
    q = gguf.quants.dequantize(parts[0].data, Q.Q8_0)
    assert torch.equal(torch.from_numpy(q), file.dense("blk.1.attn_q.weight"))


def test_not_a_gguf_is_named(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all, just bytes" * 4)
    with pytest.raises(ModelLoadError, match="junk.gguf: unreadable GGUF"):
        load_model(path)


def dequantized_names(monkeypatch) -> list[str]:
    """The GGUF tensors the reader dequantizes from here on, by name."""
    read: list[str] = []
    real = gguf_file.dequantize

    def recording(raw, where):
        read.append(raw.name)
        return real(raw, where)

    monkeypatch.setattr(gguf_file, "dequantize", recording)
    return read


def test_linears_run_on_their_blocks_are_not_dequantized(tmp_path, monkeypatch):
    _, path = hf_and_gguf(tmp_path, "llama", lambda name: Q.Q4_1)
    read = dequantized_names(monkeypatch)
    loaded = load_model(path, quantization="auto")
    assert loaded.quantization.startswith("q4 from GGUF Q4_1 blocks")
    linears = set(GGUFFile(path).linear_names())
    assert len(linears) == 14
    assert read and not linears & set(read)
    read.clear()
    load_model(path)  # the exact path dequantizes them
    assert linears <= set(read)


def k_quant_m(name: str) -> gguf.GGMLQuantizationType:
    """Q4_K_M's mix: Q6_K for v and down, Q4_K for the other linears."""
    if not name.startswith("model.layers."):
        return Q.F32
    return Q.Q6_K if name.endswith(("v_proj.weight", "down_proj.weight")) else Q.Q4_K


def test_k_quant_linears_run_on_the_files_blocks(tmp_path, monkeypatch):
    """A GGUF whose linears are all K-quants (Q4_K_M's Q4_K and Q6_K, a
    fused projection's parts of both types, Qwen2's with a bias): auto runs
    them on their blocks, never dequantized, and its logits are the exact
    model's to within the int8 inputs' rounding."""
    folder, path = hf_and_gguf(tmp_path, "qwen2", k_quant_m, hidden_size=256,
                               intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64)
    read = dequantized_names(monkeypatch)
    quantized = load_model(path, quantization="auto", dtype="float32")
    assert quantized.quantization.startswith("GGUF Q4_K/Q6_K blocks")
    assert not set(GGUFFile(path).linear_names()) & set(read)
    layer = quantized.model.layers[0]
    assert isinstance(layer.qkv_proj, KQuantLinear) and layer.qkv_proj.type_names == [
        "Q4_K", "Q6_K"]
    exact = load_model(folder)
    prompt = list(range(5, 45))
    ours = greedy_logits(quantized, prompt)
    reference = greedy_logits(exact, prompt)
    assert ((ours - reference).abs().max() / reference.std()) < 0.05


def k_quant_m_head(tied: bool):
    """Q4_K_M's mix with its Q6_K vocabulary projection: the output weight,
    or (tied) the embedding it shares."""
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return lambda name: Q.Q6_K if name == head else k_quant_m(name)


@pytest.mark.skipif(kquant_kernels() is None, reason="no native K-quant kernels on this CPU")
@pytest.mark.parametrize("tied", [False, True])
def test_a_k_quant_vocabulary_projection_runs_on_the_files_blocks(tmp_path, tied):
    """A Q6_K vocabulary projection (the output weight, or a tied embedding)
    loaded as `make serve` loads it (auto, bf16) projects on the file's
    blocks, x to int8 per super-block as llama.cpp takes it: fp32 logits
    within that rounding of the exact weights' product, a row's the same
    bits alone or among others, and the same greedy tokens decoded alone or
    verified after proposals; an output weight's dense copy is not kept. A
    chosen fp32 keeps the dense head."""
    _, path = hf_and_gguf(tmp_path, "qwen2", k_quant_m_head(tied), hidden_size=256,
                          intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, tie_word_embeddings=tied)
    quantized = load_model(path, quantization="auto")
    assert quantized.quantization.startswith("GGUF Q4_K/Q6_K blocks, Q6_K vocabulary projection")
    head = quantized.model.q8_head
    assert isinstance(head, KQuantHead) and head.type_names == ["Q6_K"]
    weight = GGUFFile(path).dense("token_embd.weight" if tied else "output.weight")
    torch.manual_seed(0)
    x = torch.randn(8, 256).bfloat16()
    expected = x.double() @ weight.double().T
    for rows in range(1, 9):
        assert head.takes(x[:rows])
        actual = head(x[:rows])
        assert actual.dtype == torch.float32
        error = (actual.double() - expected[:rows]).abs().max() / expected[:rows].abs().max()
        assert error < 2**-6, (rows, float(error))
        assert torch.equal(head(x[rows - 1 : rows]), head(x[:rows])[rows - 1 :])
    if not tied:  # the dense output weight is not kept: a placeholder holding no memory
        placeholder = quantized.model.lm_head.weight
        assert placeholder.shape == weight.shape and 0 in placeholder.stride()
        # a restricted vocabulary (a draft's) reads those rows of the blocks, dequantized
        rows = torch.tensor([3, 17, 100, 200])
        quantized.model.restrict_output_vocab(rows)
        assert torch.equal(quantized.model._head().float(), weight[rows].bfloat16().float())
    assert load_model(path, quantization="auto", dtype="float32").model.q8_head is None
    _, spec, (alone, drafted) = self_drafted(path, "auto", 16)
    assert isinstance(spec.target.model.q8_head, KQuantHead)
    assert drafted == alone


def greedy_logits(loaded, prompt: list[int]) -> torch.Tensor:
    """The last position's logits after the prompt, one whole prefill."""
    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    return runner.forward([Span(prompt, 0, [0, 1, 2])])[-1]


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def test_llama3_rope_scaling_is_read_from_the_files_rope_freqs(tmp_path):
    """A GGUF of Llama 3.1 keeps its rope scaling as one frequency divisor
    per rotary pair (rope_freqs, as llama.cpp's converter writes it): read
    from it, the model computes transformers' logits for the HF config's
    llama3 scaling, at positions far past the 32 the scaling leaves alone;
    the same file without the tensor would not."""
    model = tiny_checkpoint(tmp_path / "written", "llama", **TOKEN_IDS,
                            rope_parameters=LLAMA3_ROPE)
    path = tmp_path / "tiny-llama3.gguf"
    model.load_state_dict(write_gguf(model, path), strict=False)
    loaded = load_model(path)
    factors = loaded.config.rope.freq_factors
    assert len(factors) == loaded.config.head_dim // 2
    # short wavelengths kept, long ones divided by the factor, one between smoothed
    assert factors[0] == 1.0 and factors[-1] == 8.0 and any(1.0 < f < 8.0 for f in factors)
    tokens = torch.randint(3, VOCAB_SIZE, (120,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens[None]).logits[0]
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    ours = runner.forward([Span(tokens.tolist(), 0, list(range(30)), num_logits=120)])
    assert float((ours - expected).abs().max()) < 1e-4
    plain = dataclasses.replace(loaded.config.rope, freq_factors=())
    assert not torch.equal(inverse_frequencies(plain, loaded.config.head_dim),
                           inverse_frequencies(loaded.config.rope, loaded.config.head_dim))


def test_rope_freqs_of_the_wrong_length_are_named(tmp_path):
    model = tiny_checkpoint(tmp_path / "written", "llama", **TOKEN_IDS)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                             else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("rope_freqs.weight", np.ones(3, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="rope_freqs.weight holds 3 factors"):
        load_model(tmp_path / "odd.gguf")


def gemma3_k_m(name: str) -> gguf.GGMLQuantizationType:
    """Gemma 3 270M's Q4_K_M mix: int8 levels (Q5_0, Q8_0 for v) where a
    width is no multiple of 256, K-quants elsewhere."""
    if not name.startswith("model.layers."):
        return Q.F32
    if name.endswith("v_proj.weight"):
        return Q.Q8_0
    if name.endswith("o_proj.weight"):
        return Q.Q4_K
    return Q.Q6_K if name.endswith("down_proj.weight") else Q.Q5_0


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_0])
def test_q8_levels_times_d_are_ggmls_own_dequantization(qtype):
    from specpage.models.gguf_dequant import RawTensor
    from specpage.models.quant_load import q8_levels

    values = np.random.default_rng(4).standard_normal((48, 96)).astype(np.float32)
    values[3, :32] = 0.0  # a block of zeros: d = 0
    stored = gguf.quants.quantize(values, qtype)
    q, d = q8_levels(RawTensor("w", qtype.name, values.shape, stored))
    expected = gguf.quants.dequantize(stored, qtype)
    ours = (q.float().view(48, 3, 32) * d[..., None]).view(48, 96).numpy()
    assert np.array_equal(ours, expected)


def test_a_mixed_k_m_file_runs_each_projection_on_its_own_blocks(tmp_path, monkeypatch):
    """A _K_M file that mixes int8 levels (Q5_0, Q8_0) into its K-quants, as
    Gemma 3 270M's does: auto runs q/k/v and gate/up as Q8Linear (all-Q5_0
    ones on q5 tiles where the CPU has no AMX), o and
    down on their K-quant blocks, dequantizes none of them, and gives the
    exact model's logits to within the int8 inputs' rounding."""
    from specpage.kernels.cpu import features as cpu_features
    from specpage.layers.quant import Q8Linear, int8x_kernels

    if not int8x_kernels():
        pytest.skip("int8 products need AVX-512 VNNI")
    folder, path = hf_and_gguf(tmp_path, "qwen2", gemma3_k_m, hidden_size=256,
                               intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64)
    read = dequantized_names(monkeypatch)
    quantized = load_model(path, quantization="auto")
    assert quantized.quantization.startswith("GGUF Q4_K/Q5_0/Q6_K/Q8_0 blocks")
    assert not set(GGUFFile(path).linear_names()) & set(read)
    layer = quantized.model.layers[0]
    assert isinstance(layer.qkv_proj, Q8Linear) and isinstance(layer.gate_up_proj, Q8Linear)
    assert isinstance(layer.o_proj, KQuantLinear) and isinstance(layer.down_proj, KQuantLinear)
    # gate/up (Q5_0 both) read as the file stores them where the CPU has no
    # AMX; q/k/v (Q5_0 with a Q8_0 v) as q8 tiles
    assert layer.gate_up_proj.q5 is not cpu_features.has_amx() and not layer.qkv_proj.q5
    exact = load_model(folder)
    for ours_layer, exact_layer in zip(quantized.model.layers, exact.model.layers, strict=True):
        for name in ("qkv_proj", "gate_up_proj"):  # the int8 levels: the file's weights exactly
            assert torch.equal(getattr(ours_layer, name).dequantize(),
                               getattr(exact_layer, name).weight), name
    prompt = list(range(5, 45))
    ours = greedy_logits(quantized, prompt).float()
    reference = greedy_logits(exact, prompt)
    assert ((ours - reference).abs().max() / reference.std()) < 0.05


def test_a_projection_mixing_kinds_of_blocks_is_named(tmp_path):
    from specpage.layers.quant import int8x_kernels
    from specpage.models.quant_names import QuantizationError

    if not int8x_kernels():
        pytest.skip("int8 products need AVX-512 VNNI")

    def q5_and_k(name):
        return Q.Q4_K if name.endswith("k_proj.weight") else gemma3_k_m(name)

    _, path = hf_and_gguf(tmp_path, "qwen2", q5_and_k, hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    with pytest.raises(QuantizationError, match=r"layers.0.qkv_proj's parts are Q4_K, Q5_0, "
                                                r"Q8_0: one projection runs on"):
        load_model(path, quantization="auto")
