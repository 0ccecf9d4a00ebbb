"""Which weights each rank holds, and building its model.

Rank r of N holds, per layer, q heads r*H/N .. (r+1)*H/N - 1 and the same
share of the KV heads (rows of the fused qkv_proj, in its q, k, v layout:
models/loader.py hf_to_fused), the same share of gate and of up (rows of
gate_up_proj), and the matching input columns of o_proj and down_proj;
and vocabulary rows r*V/N .. (r+1)*V/N - 1 of embed_tokens and lm_head.
Norms are whole on every rank. A rank's ModelConfig says its heads and
intermediate size, so DecoderModel and ModelRunner (its KV tensors: this
rank's KV heads, for every block id) are built as for a whole model.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from specpage.core.config_error import ConfigError
from specpage.executor.parallel.comm import Collectives
from specpage.executor.parallel.layers import ShardedDecoderModel
from specpage.layers.rope import inverse_frequencies
from specpage.models.config import ModelConfig
from specpage.models.loader import LoadedModel, read_checkpoint, resolve_dtype

State = dict[str, torch.Tensor]


def check_divisible(config: ModelConfig, world: int) -> None:
    """Every split dimension must divide by the number of ranks."""
    sizes = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
             "vocabulary": config.vocab_size, "intermediate size": config.intermediate_size}
    bad = [f"{name} ({size})" for name, size in sizes.items() if size % world]
    if bad:
        fits = [n for n in range(1, config.num_kv_heads + 1)
                if all(size % n == 0 for size in sizes.values())]
        raise ConfigError(
            f"engine.tensor_parallel_size {world} does not divide the target's "
            f"{', '.join(bad)}; sizes that do: {', '.join(map(str, fits))}")


def rank_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's share of the heads and the MLP; the vocabulary stays whole
    (token ids and the gathered logits span it)."""
    check_divisible(config, world)
    return dataclasses.replace(
        config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world)


def shard_state(state: State, config: ModelConfig, rank: int, world: int) -> State:
    """This rank's slices of a whole model's state dict (fused names)."""
    d = config.head_dim
    q, kv = config.num_heads // world * d, config.num_kv_heads // world * d  # rows per rank
    inter, vocab = config.intermediate_size // world, config.vocab_size // world

    def rows(t: torch.Tensor, size: int) -> torch.Tensor:
        return t.narrow(0, rank * size, size)

    def columns(t: torch.Tensor, size: int) -> torch.Tensor:
        return t.narrow(1, rank * size, size) if t.dim() == 2 else t  # a bias stays whole

    out: State = {}
    for name, t in state.items():
        module = name.split(".")[-2]  # layers.3.qkv_proj.weight: qkv_proj
        if module == "qkv_proj":
            wq, wk, wv = torch.split(t, [config.num_heads * d, config.num_kv_heads * d,
                                         config.num_kv_heads * d])
            t = torch.cat([rows(wq, q), rows(wk, kv), rows(wv, kv)])
        elif module == "gate_up_proj":
            gate, up = t.chunk(2)
            t = torch.cat([rows(gate, inter), rows(up, inter)])
        elif module == "o_proj":
            t = columns(t, q)
        elif module == "down_proj":
            t = columns(t, inter)
        elif module in ("embed_tokens", "lm_head"):
            t = rows(t, vocab)
        out[name] = t.clone()  # no view keeps the whole tensor alive
    return out


def build_shard(state: State, config: ModelConfig, collectives: Collectives,
                dtype: torch.dtype, device: torch.device) -> ShardedDecoderModel:
    """This rank's model (eval mode) from a whole model's state dict."""
    with torch.device("meta"):
        model = ShardedDecoderModel(rank_config(config, collectives.world), collectives)
    model.load_state_dict(shard_state(state, config, collectives.rank, collectives.world),
                          strict=True, assign=True)
    model.inv_freq = torch.empty(0)  # the meta buffer; set for real below, as load_model does
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    model.wrap_row_parallel()
    return model


def shard_loaded(loaded: LoadedModel, collectives: Collectives) -> LoadedModel:
    """Rank 0's shard, from the whole model already loaded."""
    weight = loaded.model.embed_tokens.weight
    state = {name: t.detach() for name, t in loaded.model.state_dict().items()}
    model = build_shard(state, loaded.config, collectives, weight.dtype, weight.device)
    return _loaded(model, loaded.config, loaded.folder, loaded.identity, collectives.world)


def load_shard(path: Path, dtype: str | None, device: torch.device,
               collectives: Collectives) -> LoadedModel:
    """A worker's shard, read from the checkpoint (an HF folder, a GGUF, or
    a GGUF's metadata folder; on the CPU, only the shard moves to the device)."""
    checkpoint = read_checkpoint(path)
    model = build_shard(checkpoint.state, checkpoint.config, collectives,
                        resolve_dtype(dtype, device), device)
    return _loaded(model, checkpoint.config, checkpoint.folder, checkpoint.identity,
                   collectives.world)


def _loaded(model: ShardedDecoderModel, config: ModelConfig, folder: Path, whole: bytes,
            world: int) -> LoadedModel:
    # A shard's config: its heads and MLP share, the whole vocabulary. Its
    # identity differs from the whole model's, so forward costs timed at one
    # size are not read back at another (speculation/cost_cache.py).
    shard_identity = hashlib.sha256(whole + f"tensor-parallel {world}".encode()).digest()
    return LoadedModel(model, model.config, folder, shard_identity)
