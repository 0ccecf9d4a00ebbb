"""Loading checkpoints: an HF folder (``config.json`` + ``*.safetensors``,
sharded too) or a single GGUF file, read directly (models/gguf_file.py: its
tensors dequantized in memory, its tokenizer kept in a small folder of the
model cache, ``specpage.models.fetch.cache_dir()``)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from specpage.kernels.cpu import hugepages
from specpage.layers.rope import inverse_frequencies
from specpage.models.config import ModelConfig, ModelLoadError, is_head_folder
from specpage.models.decoder import DecoderModel
from specpage.models.eagle3 import LoadedHead, load_head
from specpage.models.gguf_file import GGUFFile, gguf_of, metadata_folder
from specpage.models.quant_names import Quantization

NO_QUANTIZATION = Quantization.parse(None)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_FUSED = {  # our parameter -> the HF tensors concatenated into it, in order
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_RENAMED = {"o_proj": "self_attn.o_proj", "down_proj": "mlp.down_proj"}
_QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}  # our name -> HF's
# Gemma 3's norms around its MLP, besides input_layernorm and post_attention_layernorm
_FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    folder: Path
    identity: bytes  # digest of the config and the weight files' headers and sizes
    quantization: str = "none"  # what models/quant_load applied to the linears


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


AUTO = "auto"


def auto_dtype(device: torch.device) -> torch.dtype:
    """The fastest dtype for the device: bf16 on CUDA, and on a CPU whose bf16
    matmuls are native (AVX-512 BF16 or AMX); fp32 elsewhere, where bf16
    products are emulated and far slower."""
    if device.type == "cpu":
        from specpage.kernels.cpu import features as cpu

        return torch.bfloat16 if cpu.has_fast_bf16() else torch.float32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    if name == AUTO:
        return auto_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown dtype {name!r}; known: {AUTO}, {', '.join(DTYPES)}") from None


def draft_dtype(dtype: str | torch.dtype | None, target: LoadedModel) -> str | torch.dtype:
    """The dtype to load a draft in: the one asked for, else the target's
    own (a q4 target computes in bf16 unless a dtype is chosen, and a draft
    left at the loader's fp32 beside it would cost twice the bytes a step)."""
    return dtype if dtype is not None else target.model.embed_tokens.weight.dtype


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> LoadedModel | LoadedHead:
    """Load an HF folder or a GGUF file into a DecoderModel (eval mode), or
    an EAGLE-3 draft head (models/eagle3.py), recognised by its config.
    quantization: models/quant_names (None: "none")."""
    Quantization.parse(quantization)  # a bad name fails before any loading
    device = torch.device(device)
    path = Path(path)
    if path.is_dir() and is_head_folder(path):
        folder = path
        files = weight_files(folder)
        head = load_head(folder, read_tensors(files), resolve_dtype(dtype, device), device,
                         identity(folder, files))
        if quantization not in (None, "none"):
            from specpage.models.quant_load import quantize_head

            head = quantize_head(head, Quantization.parse(quantization),
                                 dtype_chosen=dtype is not None)
        hugepages.pack(head.model)
        return head
    checkpoint = read_checkpoint(path, Quantization.parse(quantization),
                                 resolve_dtype(dtype, device))
    config = checkpoint.config
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DecoderModel(config)
    model.load_state_dict(checkpoint.state, strict=True, assign=True)
    model.inv_freq = torch.empty(0)  # the meta buffer; set for real below
    model = model.to(device=device, dtype=torch_dtype).eval()
    # fp32 whatever the weights' dtype, as HF keeps it
    model.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    loaded = LoadedModel(model, config, checkpoint.folder, checkpoint.identity)
    if quantization not in (None, "none"):
        from specpage.models.quant_load import quantize_loaded

        loaded = quantize_loaded(loaded, Quantization.parse(quantization), path,
                                 dtype_chosen=dtype is not None)
    hugepages.pack(loaded.model)
    return loaded


class Checkpoint(NamedTuple):
    folder: Path  # config.json and the tokenizer: the HF folder, or a GGUF's metadata folder
    config: ModelConfig
    state: dict[str, torch.Tensor]  # our parameter names (hf_to_fused)
    identity: bytes  # LoadedModel.identity


def read_checkpoint(path: Path, quantization: Quantization = NO_QUANTIZATION,
                    dtype: torch.dtype = torch.float32) -> Checkpoint:
    """The config and weights of an HF folder, or of a GGUF file (or the
    metadata folder made from one), read without writing any weights. A
    GGUF's linears that ``quantization`` will run on the file's own blocks
    are not dequantized (zeros in their place until they are swapped)."""
    gguf_path = gguf_of(path)
    if gguf_path is None:
        folder = resolve_folder(path)
        config = ModelConfig.from_folder(folder)
        files = weight_files(folder)
        return Checkpoint(folder, config, hf_to_fused(read_tensors(files), config, folder),
                          identity(folder, files))
    from specpage.models.fetch import cache_dir

    gguf = GGUFFile(gguf_path)
    config = ModelConfig.from_dict(gguf.config(), str(gguf_path))
    folder = metadata_folder(gguf, cache_dir())
    # The one place a GGUF's linears are dequantized or left to a module on
    # their stored blocks (models/quant_load: Q4_0/Q4_1, K-quants and int8
    # levels), which takes each projection from gguf.projection_parts(layer,
    # projection): its parts' bytes, [rows, bytes per row] in HF row order,
    # and their GGML types.
    on_blocks = False
    if quantization.kind != "none":
        from specpage.models.quant_load import runs_on_gguf_blocks

        on_blocks = runs_on_gguf_blocks(quantization, gguf.linear_types())
    state = hf_to_fused(gguf.tensors(dense_linears=not on_blocks, dtype=dtype), config,
                        gguf_path)
    return Checkpoint(folder, config, state, gguf.identity)


def resolve_folder(path: Path) -> Path:
    """The folder holding a checkpoint's config.json: the HF folder itself,
    or a GGUF's metadata folder (written on first use)."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix == ".gguf":
        from specpage.models.fetch import cache_dir

        return metadata_folder(GGUFFile(path), cache_dir())
    if path.is_file():
        raise ModelLoadError(f"{path}: expected an HF model folder or a .gguf file")
    return path


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as error:
            raise ModelLoadError(f"{index}: unreadable shard index ({error})") from None
        files = [folder / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")
    return files


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors ({error})") from None
    return tensors


def hf_to_fused(
    tensors: dict[str, torch.Tensor], config: ModelConfig, folder: Path
) -> dict[str, torch.Tensor]:
    """HF tensor names -> this model's state dict (q/k/v and gate/up fused)."""

    def take(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ModelLoadError(f"{folder}: weights lack tensor {name!r}") from None

    state = {"embed_tokens.weight": take("model.embed_tokens.weight"),
             "norm.weight": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    biases = {"qkv_proj": config.qkv_bias, "o_proj": config.o_bias,
              "gate_up_proj": config.mlp_bias, "down_proj": config.mlp_bias}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.family == "gemma3":
            norms.extend(_FEEDFORWARD_NORMS)
        for norm in norms:
            state[f"{ours}{norm}.weight"] = take(f"{hf}{norm}.weight")
        if config.qk_norm:
            for name, hf_name in _QK_NORMS.items():
                state[f"{ours}{name}.weight"] = take(f"{hf}{hf_name}.weight")
        for name, has_bias in biases.items():
            parts = _FUSED.get(name) or (_RENAMED[name],)
            for kind in ("weight", "bias") if has_bias else ("weight",):
                state[f"{ours}{name}.{kind}"] = _cat_rows([take(f"{hf}{p}.{kind}")
                                                           for p in parts])
    _check_shapes(state, config, folder)
    return state


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along the rows; placeholders (a weight left to a
    module on a GGUF's blocks: one zero, expanded) stay one, of no memory."""
    if all(p.ndim == 2 and p.stride() == (0, 0) for p in parts):
        return parts[0].new_zeros(()).expand(sum(p.shape[0] for p in parts), parts[0].shape[1])
    return torch.cat(parts)


def _check_shapes(state: dict[str, torch.Tensor], config: ModelConfig, folder: Path) -> None:
    embed = state["embed_tokens.weight"]
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(
            f"{folder}: embed_tokens is {tuple(embed.shape)}, config says "
            f"({config.vocab_size}, {config.hidden_size})"
        )


def identity(folder: Path, files: list[Path]) -> bytes:
    """A digest naming this checkpoint: config, and each weight file's size and
    header (names, shapes, offsets). Cheap, and enough to keep two models'
    prefix-cache entries apart."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in files:
        with file.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            digest.update(re.sub(rb"\s", b"", handle.read(min(header_len, 1 << 24))))
        digest.update(str(file.stat().st_size).encode())
    return digest.digest()


DRAFT_VOCAB_FILE = "draft_vocab.json"


def draft_vocabulary(draft: LoadedModel) -> list[int] | None:
    """The tokens a draft proposes from, when its folder lists them in
    draft_vocab.json ({"token_ids": [...]}, e.g. every token of the target
    answers it was distilled from); None: the whole vocabulary."""
    path = draft.folder / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"{path}: expected {{\"token_ids\": [...]}} ({error})") from error
    if not isinstance(ids, list) or not ids or not all(
        isinstance(i, int) and 0 <= i < draft.config.vocab_size for i in ids
    ):
        raise ModelLoadError(
            f"{path}: token_ids must be a non-empty list of ids in 0..{draft.config.vocab_size - 1}"
        )
    return ids


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must score the target's vocabulary with the same tokenizer."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"draft vocabulary ({draft.config.vocab_size} tokens, {draft.folder}) differs from "
            f"the target's ({target.config.vocab_size}, {target.folder})"
        )
    files = [m.folder / "tokenizer.json" for m in (target, draft)]
    if all(f.is_file() for f in files):
        vocabs = [json.loads(f.read_text()).get("model", {}).get("vocab") for f in files]
        if vocabs[0] != vocabs[1]:
            raise ModelLoadError(
                f"draft tokenizer ({files[1]}) does not match the target's ({files[0]})"
            )


def check_head_compatible(target: LoadedModel, head: LoadedHead) -> None:
    """An EAGLE-3 head must read the target's hidden states and score its
    vocabulary (it embeds tokens with the target's embedding)."""
    c, t = head.config, target.config
    problems = []
    if t.family == "gemma3":
        problems.append("Gemma 3's scaled embedding is not what a head embeds tokens with")
    if c.layer.vocab_size != t.vocab_size:
        problems.append(f"vocabulary {c.layer.vocab_size} tokens, the target's {t.vocab_size}")
    if c.target_hidden_size != t.hidden_size:
        problems.append(f"reads hidden states of size {c.target_hidden_size}, the target's "
                        f"are {t.hidden_size}")
    if head.model.embed_tokens is None and c.layer.hidden_size != t.hidden_size:
        problems.append(f"hidden size {c.layer.hidden_size} cannot use the target's "
                        f"embedding ({t.hidden_size})")
    if problems:
        raise ModelLoadError(f"EAGLE-3 head {head.folder} does not fit the target "
                             f"{target.folder}: " + "; ".join(problems))
    c.layers_of(t.num_layers)  # raises if the tapped layers are not the target's
