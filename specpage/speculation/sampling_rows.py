"""Per-row sampling parameters as tensors, the logits of rows adjusted by
their samples' histories, and the seeded uniforms of rows."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from specpage.core.step import Adjustments, Sampling
from specpage.kernels.cpu.native import loaded_kernels
from specpage.speculation.sampler import Adjustment, Purpose, adjusted, probabilities, uniform


def row_probabilities(logits: torch.Tensor, rows: Seq[Sampling]) -> torch.Tensor:
    """logits [rows, vocab], one sample's parameters per row -> probabilities [rows, vocab]."""
    return probabilities(
        logits,
        torch.tensor([r.temperature for r in rows], dtype=torch.float32),
        torch.tensor([r.top_k for r in rows], dtype=torch.int64),
        torch.tensor([r.top_p for r in rows], dtype=torch.float32),
        # none to apply in the common case: every row's min_p is 0
        torch.tensor([r.min_p for r in rows]) if any(r.min_p for r in rows) else None,
    )


def temperature_kernels(logits: torch.Tensor, rows: Seq[Sampling]) -> Any:
    """The native kernels, where they can take these sampled rows' draws
    (kernels/cpu/sampling.cpp: CPU fp32 logits, every row at a temperature
    alone, with no top-k, top-p or min-p; their history's adjustments are
    in the logits already); else None, and sampler.py takes them."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        return None
    if not all(r.top_k == 0 and r.top_p >= 1.0 and r.min_p == 0.0 and not r.greedy
               for r in rows):
        return None
    return loaded_kernels()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as torch.argmax gives it, of logits [rows, vocab]:
    on kernels/cpu/sampling.cpp's greedy_tokens for CPU fp32 rows (torch's
    takes ~320 microseconds for one row of 262144)."""
    kernels = loaded_kernels()
    if (kernels is None or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1):
        return logits.argmax(-1).tolist()  # type: ignore[no-any-return]
    return kernels.greedy_tokens(logits).tolist()  # type: ignore[attr-defined, no-any-return]


def adjusted_rows(
    logits: torch.Tensor,  # [rows, vocab] fp32
    rows: Seq[Sampling],
    num_tokens: Seq[int],  # per row: tokens its sample holds (prompt, output, added)
    added: Seq[Seq[int]],  # per row: tokens its sample holds past its Sampling's history
) -> torch.Tensor:
    """The logits each row samples from, its sample's history applied, as if
    the sample held its `added` tokens too (a proposal's prefix before the
    row, so each verified row sees the history it would have had the
    proposal been accepted up to it). `logits` itself when no row adjusts."""
    found = [(i, r.adjustments) for i, r in enumerate(rows) if r.adjustments is not None]
    if not found:
        return logits
    which = [i for i, _ in found]
    vocab = logits.shape[-1]
    bias = torch.zeros(len(which), vocab)
    counts = torch.zeros(len(which), vocab)
    seen = torch.zeros(len(which), vocab, dtype=torch.bool)
    histories: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # shared by a sample's rows
    for row, (i, a) in enumerate(found):
        if a.logit_bias:
            bias[row, list(a.logit_bias)] = torch.tensor(list(a.logit_bias.values()))
        if num_tokens[i] - a.num_prompt < a.min_tokens and a.banned:
            bias[row, a.banned] = float("-inf")
        if a.history:  # penalized
            if id(a) not in histories:
                histories[id(a)] = _history(a, vocab)
            output_counts, prompt_seen = histories[id(a)]
            counts[row] = output_counts
            if added[i]:
                counts[row] += torch.bincount(torch.tensor(added[i]), minlength=vocab)
            seen[row] = prompt_seen | (counts[row] > 0)
    made = Adjustment(bias, counts, seen, torch.tensor([a.presence for _, a in found]),
                      torch.tensor([a.frequency for _, a in found]),
                      torch.tensor([a.repetition for _, a in found]))
    out = logits.clone()
    out[which] = adjusted(logits[which], Adjustment(*(t.to(logits.device) for t in made)))
    return out


# byte -> the additive bias of its 8 tokens: 0 where its bit is set, else -inf
_BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(),
                         0.0, float("-inf"))


def mask_rows_(logits: torch.Tensor, rows: list[int], masks: bytes) -> None:
    """-inf, in place, at every token of logits' rows (in that order, one
    mask each in masks) that the grammar's bitmask forbids: one native pass
    over CPU fp32 rows (specpage/kernels/cpu/fused_ops.cpp), else the bias
    below added."""
    kernels = loaded_kernels() if (logits.device.type == "cpu"
                                   and logits.dtype == torch.float32) else None
    packed = torch.frombuffer(bytearray(masks), dtype=torch.uint8).view(len(rows), -1)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    with torch.inference_mode():  # the forward's logits are inference tensors
        if kernels is not None and logits.stride(1) == 1:
            kernels.grammar_mask_(logits, index, packed)  # type: ignore[attr-defined]
            return
        logits.index_add_(0, index, grammar_bias(masks, len(rows), logits.shape[-1])
                          .to(logits.device))


def grammar_bias(mask: bytes, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] fp32 from a grammar's bitmasks (core/grammar.py: per row
    one bit per token, 32 to a little-endian int32): 0 where a token is
    allowed, -inf where it is not (and past the mask's width). Added, not
    written where forbidden: a branch per token is several times slower."""
    packed = torch.frombuffer(bytearray(mask), dtype=torch.uint8).view(rows, -1)
    bias = torch.nn.functional.embedding(packed.long(), _BYTE_BIAS).view(rows, -1)
    if bias.shape[1] >= vocab:
        return bias[:, :vocab]
    return torch.cat([bias, bias.new_full((rows, vocab - bias.shape[1]), float("-inf"))], 1)


def _history(a: Adjustments, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[vocab] fp32 counts of the output's tokens, [vocab] bool of the prompt's."""
    output = torch.tensor(a.history[a.num_prompt :], dtype=torch.int64)
    prompt_seen = torch.zeros(vocab, dtype=torch.bool)
    prompt_seen[a.history[: a.num_prompt]] = True
    return torch.bincount(output, minlength=vocab).float(), prompt_seen


def uniforms(rows: Seq[Sampling], positions: Seq[int], purpose: Purpose) -> torch.Tensor:
    """[rows] fp64: the draw for each sample's token at that position."""
    return torch.tensor(
        [uniform(r.seed, p, purpose) for r, p in zip(rows, positions, strict=True)],
        dtype=torch.float64,
    )
