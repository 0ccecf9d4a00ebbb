"""Loading checkpoints: dtypes, and clear errors for what cannot be loaded."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpage.engine.builder import load_tokenizer
from specpage.models.config import ModelConfig, ModelLoadError
from specpage.models.fetch import ensure_model
from specpage.models.loader import check_draft_compatible, load_model
from tests.support.checkpoints import family_checkpoint, tiny_checkpoint


def test_fp32_by_default_on_cpu_and_bf16_selectable(tmp_path):
    tiny_checkpoint(tmp_path)
    assert load_model(tmp_path).model.embed_tokens.weight.dtype == torch.float32
    loaded = load_model(tmp_path, dtype="bf16")
    assert loaded.model.layers[0].qkv_proj.weight.dtype == torch.bfloat16
    assert loaded.model.inv_freq.dtype == torch.float32


def test_identity_differs_between_checkpoints(tmp_path):
    tiny_checkpoint(tmp_path / "a", seed=0)
    tiny_checkpoint(tmp_path / "b", seed=0, num_hidden_layers=3)
    a1, a2 = load_model(tmp_path / "a"), load_model(tmp_path / "a")
    assert a1.identity == a2.identity != load_model(tmp_path / "b").identity


def test_unsupported_architecture_is_named(tmp_path):
    tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


def test_unsupported_rope_type_is_named():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_dict(raw)
    del raw["rope_scaling"], raw["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing field 'hidden_size'"):
        ModelConfig.from_dict(raw)


def test_sliding_window_bounds_the_context():
    raw = {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "max_position_embeddings": 32768, "sliding_window": 4096}
    assert ModelConfig.from_dict(raw).max_position == 4096


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(tmp_path / "nothing")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "empty")
    tiny_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(tmp_path / "m")


def test_corrupt_weights_are_named(tmp_path):
    tiny_checkpoint(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or unreadable"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(tmp_path)


def test_missing_shard_and_missing_tensor_are_named(tmp_path):
    tiny_checkpoint(tmp_path / "sharded", shard=True)
    shard = sorted((tmp_path / "sharded").glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing shard"):
        load_model(tmp_path / "sharded")
    tiny_checkpoint(tmp_path / "bigger", num_hidden_layers=3)
    tiny_checkpoint(tmp_path / "smaller", num_hidden_layers=2)
    shutil.copy(tmp_path / "bigger" / "config.json", tmp_path / "smaller" / "config.json")
    with pytest.raises(ModelLoadError, match="weights lack tensor 'model.layers.2"):
        load_model(tmp_path / "smaller")


def test_draft_with_another_vocabulary_is_rejected(tmp_path):
    tiny_checkpoint(tmp_path / "t")
    target = load_model(tmp_path / "t")
    tiny_checkpoint(tmp_path / "d", vocab_size=300)
    with pytest.raises(ModelLoadError, match="draft vocabulary \\(300 tokens"):
        check_draft_compatible(target, load_model(tmp_path / "d"))
    tiny_checkpoint(tmp_path / "ok", num_hidden_layers=1)
    check_draft_compatible(target, load_model(tmp_path / "ok"))


def test_draft_with_another_tokenizer_is_rejected(tmp_path):
    tiny_checkpoint(tmp_path / "t")
    tiny_checkpoint(tmp_path / "d", num_hidden_layers=1)
    for name, vocab in (("t", {"a": 0, "b": 1}), ("d", {"a": 1, "b": 0})):
        (tmp_path / name / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ModelLoadError, match="draft tokenizer .* does not match"):
        check_draft_compatible(load_model(tmp_path / "t"), load_model(tmp_path / "d"))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_loading_a_model_imports_neither_dynamo_nor_triton(tmp_path, family):
    """A model is built on the meta device and loaded over: nothing of its
    construction may run through torch's Python references, which import
    torch._dynamo and triton (seconds of every start, and triton's leak
    report at exit)."""
    if family == "llama":
        tiny_checkpoint(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})
    else:
        family_checkpoint(tmp_path, family)
    script = (
        "import sys\n"
        "from specpage.models.loader import load_model\n"
        f"model = load_model({str(tmp_path)!r}, quantization='auto').model\n"
        "assert model.embed_tokens.weight.device.type == 'cpu'\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_plain_fast_tokenizer_loads_as_autotokenizer_would(tmp_path):
    """load_tokenizer takes transformers' fast tokenizer directly where
    tokenizer_config.json names it (skipping AutoTokenizer's imports): the
    same class, vocabulary, special tokens, chat template and token ids."""
    from transformers import AutoTokenizer

    folder = ensure_model("smollm2-135m")
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(theirs)
    assert ours.chat_template == theirs.chat_template
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.model_max_length == theirs.model_max_length
    text = "Hello wörld! <|im_start|>user\n 12345 \t tabs  — 🙂"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    chat = [{"role": "user", "content": "Hi"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, add_generation_prompt=True))
    # another class named: AutoTokenizer chooses, as before
    other = tmp_path / "other"
    other.mkdir()
    for file in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(folder / file, other / file)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(
        {**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(load_tokenizer(other)) is type(AutoTokenizer.from_pretrained(other))
