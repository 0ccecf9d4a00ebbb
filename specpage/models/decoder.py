"""Decoder-only transformer of the Llama family (Llama 2/3, SmolLM, TinyLlama,
Mistral), Qwen2 (bias on q/k/v), Qwen3 (q/k norms) and Gemma 3 (models/
gemma3.py), written against the paged-attention interface: each layer's
window, if it has one, goes to the backend with its attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.layers import native_stack
from specpage.layers.products import PackedWeight, cpu_linear, row_invariant_on
from specpage.layers.rope import cos_sin, inverse_frequencies
from specpage.models.config import ModelConfig
from specpage.models.gemma3 import Gemma3Layer, ScaledEmbedding
from specpage.models.layer import DecoderLayer

# family -> its layer and embedding, where they are not DecoderLayer and nn.Embedding
LAYERS: dict[str, type[DecoderLayer]] = {"gemma3": Gemma3Layer}
EMBEDDINGS: dict[str, type[nn.Embedding]] = {"gemma3": ScaledEmbedding}

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [num_tokens, head_dim]


class LayerTap:
    """Collects the residual stream entering some layers (HF's
    hidden_states[i] for layer i) during a forward, in layer order: the
    features an EAGLE-3 head reads (models/eagle3.py)."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = layers
        self.states: list[torch.Tensor] = []  # each [num_tokens, hidden]

    def see(self, index: int, x: torch.Tensor) -> None:
        self.states.extend([x] * self.layers.count(index))  # a layer may be named twice


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        embedding = EMBEDDINGS.get(config.family, nn.Embedding)
        # A weight given skips the random start that loading replaces: built
        # on the meta device (models/loader.py), nn.init.normal_ imports
        # torch._dynamo and with it triton, 1.5 s of every start and
        # triton's leak report when the process exits.
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size))
        layer = LAYERS.get(config.family, DecoderLayer)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_layers))
        self.norm = layer.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._head_t: torch.Tensor | None = None
        self._head_packed = PackedWeight()
        # The vocabulary projection of a few rows on the head's own Q8_0
        # blocks (layers/quant.py Q8Head), set by a q4 load from a GGUF.
        self.q8_head: nn.Module | None = None
        # native_stack.stack_plan by row count, made on first use; cleared
        # when the model's tensors are replaced (.to() and the like).
        self._stack_plans: dict[tuple[int, bool], native_stack.StackPlan | None] = {}
        # by whether it is the sliding layers' (config.local_rope): (the
        # inv_freq it was made for, cos, sin), DecoderModel.rope_rows
        self._rope_tables: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # A draft may propose from part of the vocabulary only: its projection
        # then reads only those rows (see restrict_output_vocab).
        self.output_vocab: torch.Tensor | None = None
        self._head_rows: torch.Tensor | None = None
        self.register_buffer(
            "inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        caches: list[torch.Tensor],  # one [2, num_blocks, block_size, kv_heads, d] per layer
        meta: AttentionMetadata | list[AttentionMetadata],  # all layers', or each layer's
        backend: AttentionBackend,
        logits_index: torch.Tensor,  # [num_logits] int64, rows to score, ascending, once each
        tap: LayerTap | None = None,
    ) -> torch.Tensor:
        """Logits [num_logits, vocab] in fp32 for the tokens in logits_index."""
        x = self.embed_tokens(input_ids)
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        # the largest position + 1 where the metadata knows it: no device sync
        rope = self.rope_rows(positions, x.dtype, getattr(metas[0], "max_context", None)
                              if metas else None)
        local = self.rope_rows(positions, x.dtype, local=True) if self.config.local_rope else rope
        # The stream after the last layer's attention, and that layer's MLP
        # branch, not yet added (None without layers).
        ran = native_stack.run_layers(self, x, (rope, local), caches, metas, backend, tap)
        x, branch = ran if ran is not None else self._run_layers(x, (rope, local), caches, metas,
                                                                 backend, tap)
        if logits_index.shape[0] != x.shape[0]:  # else every row, in order
            x = x[logits_index]
            branch = None if branch is None else branch[logits_index]
        return self.logits(x, branch)

    def logits(self, x: torch.Tensor, branch: torch.Tensor | None) -> torch.Tensor:
        """Logits [rows, vocab] in fp32 from the stream after the last
        layer's attention and that layer's MLP branch (None: x is the
        stream after the last layer).

        No rows (a forward whose spans want no logits: prefill chunks, or a
        span that stops short of its newest token) project nothing: the
        products' kernels take at least one row (bf16_gemv 1 to 16). Its
        columns are the projection's (a tensor-parallel rank's share)."""
        head = self._head()
        if x.shape[0] == 0:
            return torch.empty((0, self.config.vocab_size if self.output_vocab is not None
                                else head.shape[0]), dtype=torch.float32, device=x.device)
        if branch is None:
            x = self.norm(x)
        else:
            _, x = self.norm.after_add(branch, x)
        if self.q8_head is not None and self.output_vocab is None and self.q8_head.takes(x):
            logits = self.q8_head(x).float()
        elif (x.shape[0] == 1 and head.device.type == "cpu" and head.dtype == torch.float32
              and not row_invariant_on()):
            logits = (x @ self._transposed_head(self._dense(head))).float()
        else:
            logits = cpu_linear(x, self._dense(head), None, self._head_packed).float()
        if self.output_vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.output_vocab, logits)

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype, need: int | None = None,
                  local: bool = False) -> Rope:
        """cos and sin for these positions, rows of a table made for the first
        positions once (grown by doubling) instead of ~7 small ops per
        forward. Each row is what cos_sin computes for its position alone.
        need: the largest position + 1, where the caller knows it. local:
        the sliding layers' rotary (config.local_rope)."""
        if need is None:
            need = int(positions.max()) + 1
        table = self._rope_tables.get(local)
        if (table is None or table[0] is not self.inv_freq or table[1].dtype != dtype
                or table[1].shape[0] < need):
            size = max(need, min(max(1024, 1 << (need - 1).bit_length()),
                                 self.config.max_position))
            inv_freq = self.inv_freq
            if local:  # in fp32 from the config, whatever .to() did to the buffers
                assert self.config.local_rope is not None
                inv_freq = inverse_frequencies(self.config.local_rope, self.config.head_dim).to(
                    self.inv_freq.device)
            cos, sin = cos_sin(inv_freq, torch.arange(size, device=inv_freq.device), dtype)
            table = self._rope_tables[local] = (self.inv_freq, cos, sin)
        return table[1].index_select(0, positions), table[2].index_select(0, positions)

    @property
    def stack_plans(self) -> dict[tuple[int, bool], native_stack.StackPlan | None]:
        """The native stack plans made so far, by row count and whether the
        products are row-invariant. A new dict
        whenever the model's tensors are replaced (.to() and the like), so
        its identity tells a caller that caches the tensors when to look
        them up again."""
        return self._stack_plans

    @property
    def quantized_head(self) -> nn.Module | None:
        """The Q8_0 vocabulary projection (layers/quant.py Q8Head), or None.
        Read from _modules directly: a property is found on the class, not
        through nn.Module.__getattr__, which is slow on a cold cache."""
        return self._modules.get("q8_head")

    def stack_plan(self, rows: int) -> native_stack.StackPlan | None:
        """The layers' native call for `rows` rows (layers/native_stack.py)."""
        key = (rows, row_invariant_on())  # the products differ by mode
        if key not in self._stack_plans:
            self._stack_plans[key] = native_stack.stack_plan(self.layers, rows)
        return self._stack_plans[key]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> DecoderModel:
        self._stack_plans = {}
        return super()._apply(fn, recurse)

    def _run_layers(
        self, x: torch.Tensor, ropes: tuple[Rope, Rope], caches: list[torch.Tensor],
        metas: list[AttentionMetadata], backend: AttentionBackend, tap: LayerTap | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ropes: the full-attention layers' rotary rows, and the sliding layers' own;
        metas: each layer's attention metadata."""
        branch: torch.Tensor | None = None
        for index, (layer, cache, meta) in enumerate(zip(self.layers, caches, metas,
                                                         strict=True)):
            norm = layer.input_layernorm
            x, normed = (x, norm(x)) if branch is None else norm.after_add(branch, x)
            if tap is not None:
                tap.see(index, x)
            x, branch = layer(x, normed, ropes[layer.local_rope], cache, meta, backend)
        return x, branch

    def restrict_output_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Score only these tokens; every other one gets logit -inf, so is
        never proposed and has probability 0. For a draft, whose vocabulary
        projection is a large share of its cost: a draft distilled from a
        target's answers need not score tokens those answers never use.
        None scores the whole vocabulary again."""
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.int64).unique()
            if token_ids.numel() == 0 or not 0 <= int(token_ids[0]) <= int(token_ids[-1]) < (
                self.config.vocab_size
            ):
                raise ValueError(f"output vocabulary must be token ids in 0..."
                                 f"{self.config.vocab_size - 1}, at least one")
            token_ids = token_ids.to(self.embed_tokens.weight.device)
        self.output_vocab, self._head_rows, self._head_t = token_ids, None, None

    def _head(self) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.output_vocab is None:
            return head
        if self._head_rows is None or self._head_rows.dtype != head.dtype:
            self._head_rows = self._dense(head).detach()[self.output_vocab].contiguous()
        return self._head_rows

    def _dense(self, head: torch.Tensor) -> torch.Tensor:
        """head, or where only a placeholder of it is kept (a K-quant head
        computes the logits on the file's blocks: models/quant_load.py
        _head_on_blocks), those blocks dequantized, in head's dtype."""
        if 0 not in head.stride():
            return head
        assert self.q8_head is not None, "a placeholder head without its blocks"
        dense: torch.Tensor = self.q8_head.dequantize()
        return dense.to(head.dtype)

    def _transposed_head(self, head: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection as [hidden, vocab], made once (one more
        copy of it in memory, for a faster single-row product on CPU: see
        docs/BENCHMARKS.md, "CPU products: BLAS by row count")."""
        if self._head_t is None or self._head_t.dtype != head.dtype:
            self._head_t = head.detach().T.contiguous()
        return self._head_t
