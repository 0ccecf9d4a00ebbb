"""Log-probabilities as callers see them: the target's own (log-softmax of
its logits, before temperature and any adjustment), for chosen tokens, the
likeliest alternatives at a position, and prompt tokens with their ranks."""

from __future__ import annotations

import torch

from specpage.core.request import TokenLogprobs

Top = list[tuple[int, float]]  # (token id, log-probability), likeliest first


def top_of(log_probs: torch.Tensor, n: int) -> list[Top]:
    """The n likeliest tokens of each row of log_probs [rows, vocab]."""
    if n == 0:
        return [[] for _ in range(log_probs.shape[0])]
    values, ids = log_probs.topk(n, dim=-1)  # [rows, n], sorted likeliest first
    return [list(zip(i, v, strict=True))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def of_tokens(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprobs]:
    """logits [rows, vocab] fp32 at the positions before tokens (one each):
    each token's log-probability and rank there, and the n likeliest."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.int64, device=log_probs.device)
    chosen = log_probs.gather(1, index[:, None])  # [rows, 1]
    ranks = ((log_probs > chosen).sum(-1) + 1).tolist()  # [rows]
    return [TokenLogprobs(logprob, rank, top) for logprob, rank, top in zip(
        chosen[:, 0].tolist(), ranks, top_of(log_probs, n), strict=True)]
