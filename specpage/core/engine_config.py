"""The engine's settings: one type, one default per field.

The daemon's ``[engine]`` config section decodes into it and ``Engine``
takes it as it is, so a field added here is settable from the config
file, the environment and ``--set`` at once. Pure Python; no torch.
"""

from __future__ import annotations

import msgspec

from specpage.core.config_error import require
from specpage.core.ngram import MAX_NGRAM
from specpage.core.request import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, StopLimits

# Fraction of the pool kept free when admitting a request while others run,
# so running sequences can still grow by a step or two without preempting.
ADMISSION_WATERMARK = 0.02
MODEL_FREE_METHODS = ("ngram", "suffix", "corpus")  # core/model_free.py's (vLLM's names first)


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 64
    max_step_tokens: int = 512  # target positions per step: prefill chunks + verification
    max_context: int = 2048  # capped by both models' own limits
    spec_k: int = 4  # proposals per step at most; 0: plain decoding through the same path
    adaptive_k: bool = True
    # proposers that need no model (core/model_free.py), comma-separated:
    # "ngram" (prompt lookup in the sequence's own context), "suffix" (earlier
    # requests' texts of the same cache salt), "corpus" (a fixed table of the
    # target's own answers, spec_corpus); "" for none
    spec_methods: str = "ngram,suffix,corpus"
    # the corpus method's table (core/corpus.py): "auto", the one that ships
    # for the target's vocabulary if any (else the method is off); or a
    # table file's path, which must be of the target's vocabulary
    spec_corpus: str = "auto"
    spec_ngram_min: int = 1  # n-gram lengths matched, longest first
    spec_ngram_max: int = 4
    spec_model_free_k: int = 8  # model-free proposals per step at most
    spec_suffix_cache_tokens: int = 65536  # earlier requests' tokens kept, all salts together
    admission_watermark: float = ADMISSION_WATERMARK
    max_stop_strings: int = MAX_STOP_STRINGS  # per request; beyond, INVALID_ARGUMENT
    max_stop_chars: int = MAX_STOP_CHARS  # all of a request's stop strings together
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    # ranks the target's forward is split over (specpage.executor.parallel)
    tensor_parallel_size: int = 1
    # A request's tokens the same bit for bit whatever else runs: other
    # requests, speculation (on or off, any k, any proposer), prefill chunks,
    # prefix-cache hits, preemption; in every dtype. The target's products
    # and attention compute each position alone (executor/model_runner.py),
    # and a sampled token is the seeded draw from the target's distribution
    # at its position, which a proposal must equal to be accepted
    # (speculation/verifier.py). Its cost: docs/BENCHMARKS.md, "Deterministic mode".
    deterministic: bool = False
    # On CUDA, forwards of short spans (decoding, a draft's proposal steps,
    # verification: up to 16 tokens per sequence, up to max_num_seqs)
    # replayed from captured graphs (executor/cuda_graphs.py); no effect on
    # CPU. Off by default: on an H200 decode graphs made single-stream
    # decoding 8.8x faster, and then faulted (an illegal memory access) at 32
    # streams; the likely cause (a buffer freed after its capture) is mended,
    # not yet checked on a GPU.
    cuda_graphs: bool = False
    # A target with sliding-window layers (Gemma 3's local ones) keeps their
    # KV in block tables of their own that give back the blocks behind the
    # window (core/layer_groups.py, as vLLM's hybrid allocator): num_blocks
    # then counts blocks of every layer, and the pool pages of one layer
    # group each. With a draft model or head, or tensor parallelism: off.
    hybrid_kv: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_step_tokens", "max_context",
                     "max_stop_strings", "max_stop_chars", "max_stop_token_ids",
                     "tensor_parallel_size"):
            require(getattr(self, name) > 0, f"engine.{name} must be > 0", getattr(self, name))
        require(self.spec_k >= 0, "engine.spec_k must be >= 0", self.spec_k)
        # a decoding sequence may need two positions plus k in one step
        require(self.max_step_tokens >= self.spec_k + 2,
                f"engine.max_step_tokens must be >= spec_k + 2 ({self.spec_k + 2})",
                self.max_step_tokens)
        unknown = set(self.model_free_methods) - set(MODEL_FREE_METHODS)
        require(not unknown, f"engine.spec_methods: unknown {sorted(unknown)}; known: "
                f"{', '.join(MODEL_FREE_METHODS)}", self.spec_methods)
        require(1 <= self.spec_ngram_min <= self.spec_ngram_max,
                "engine.spec_ngram_min must be in 1..spec_ngram_max", self.spec_ngram_min)
        require(self.spec_ngram_max <= MAX_NGRAM,
                f"engine.spec_ngram_max must be at most {MAX_NGRAM}", self.spec_ngram_max)
        require(self.spec_model_free_k >= 0, "engine.spec_model_free_k must be >= 0",
                self.spec_model_free_k)
        require(self.spec_suffix_cache_tokens >= 0,
                "engine.spec_suffix_cache_tokens must be >= 0", self.spec_suffix_cache_tokens)
        require(not (self.deterministic and self.tensor_parallel_size > 1),
                "engine.deterministic takes tensor_parallel_size 1", self.tensor_parallel_size)
        require(0 <= self.admission_watermark < 1,
                "engine.admission_watermark must be in [0, 1)", self.admission_watermark)

    @property
    def model_free_methods(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.spec_methods.split(",") if m.strip())

    @property
    def model_free_k(self) -> int:
        """Model-free proposals per step at most: 0 when no method is on,
        and never more than a decoding step's budget leaves."""
        if not self.model_free_methods:
            return 0
        return min(self.spec_model_free_k, self.max_step_tokens - 2)

    @property
    def stop_limits(self) -> StopLimits:
        return StopLimits(self.max_stop_strings, self.max_stop_chars, self.max_stop_token_ids)
