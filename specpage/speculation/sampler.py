"""Sampling: logits adjusted by a sample's history (penalties, logit bias,
bans), temperature, min-p, top-k and top-p into probabilities, and draws
that depend only on (seed, position, purpose), so a seeded request samples
the same tokens whatever else is in the batch and however its steps fall."""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from specpage.core.request import GREEDY_BELOW

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """Independent random streams per position."""

    SAMPLE = 1  # plain sampling and the bonus token
    DRAFT = 2  # the draft's proposal
    ACCEPT = 3  # the acceptance test of a proposal
    RESIDUAL = 4  # the recovered token after a rejection


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform in [0, 1) from splitmix64 over (seed, position, purpose)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + purpose) & _MASK64
    for _ in range(2):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return (x >> 11) / float(1 << 53)


class Adjustment(NamedTuple):
    """What rows' histories do to their logits, as tensors (built by
    sampling_rows.py, one row per logit row that has any)."""

    bias: torch.Tensor  # [rows, vocab] fp32: logit_bias, -inf where banned (min_tokens)
    counts: torch.Tensor  # [rows, vocab] fp32: each token's count in the output so far
    seen: torch.Tensor  # [rows, vocab] bool: in the prompt or in the output so far
    presence: torch.Tensor  # [rows] fp32
    frequency: torch.Tensor  # [rows] fp32
    repetition: torch.Tensor  # [rows] fp32; 1 is off


def adjusted(logits: torch.Tensor, a: Adjustment) -> torch.Tensor:
    """logits [rows, vocab] fp32 as vLLM adjusts them: bias and bans first,
    then the repetition penalty (a positive logit divided by it, a negative
    one multiplied), then the frequency and presence penalties."""
    logits = logits + a.bias
    penalty = torch.where(a.seen, a.repetition[:, None], 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
    return logits - a.frequency[:, None] * a.counts - a.presence[:, None] * (a.counts > 0)


def probabilities(
    logits: torch.Tensor,  # [rows, vocab] fp32
    temperature: torch.Tensor,  # [rows] fp32; 0 is greedy (one-hot at the argmax)
    top_k: torch.Tensor,  # [rows] int64; 0 keeps every token
    top_p: torch.Tensor,  # [rows] fp32 in (0, 1]
    min_p: torch.Tensor | None = None,  # [rows] fp32 in [0, 1]; None: 0 for every row
) -> torch.Tensor:
    """The distribution each row samples from, [rows, vocab] fp32."""
    greedy = temperature < GREEDY_BELOW
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if min_p is not None and bool((min_p > 0).any()):
        # after temperature, before top-k and top-p, as in vLLM
        floor = probs.amax(-1, keepdim=True) * min_p.to(probs.device)[:, None]
        probs = torch.where(probs < floor, 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(((top_k > 0) | (top_p < 1)).any()):
        probs = _top_k_top_p(probs, top_k, top_p)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    # Keep a token while the mass before it is below top_p; the first always stays.
    before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (rank < k) & ((before < top_p[:, None]) | (rank == 0))
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: probs [rows, vocab], uniforms [rows] -> [rows] int64."""
    cdf = probs.double().cumsum(-1)
    u = uniforms.double()[:, None] * cdf[:, -1:]  # scaled, so rounding never overshoots
    index = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)
