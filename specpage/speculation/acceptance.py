"""Lossless acceptance of proposals (Leviathan et al., Chen et al.).

For proposal j with draft probability q and target probability p: accept with
probability min(1, p(d_j) / q(d_j)); at the first rejection sample the
recovered token from norm(max(0, p - q)); when all are accepted sample the
bonus token from the target's next distribution. The output is distributed
exactly as the target's. Greedy rows have one-hot p and q, which makes this
"accept while the draft token equals the target's argmax".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specpage.speculation.sampler import sample


class Acceptance(NamedTuple):
    num_accepted: list[int]  # per row
    next_token: list[int]  # the recovered or bonus token of each row


def accept(
    draft_tokens: torch.Tensor,  # [rows, k_max] int64, padded past num_proposed
    draft_probs: torch.Tensor,  # [rows, k_max, vocab]
    target_probs: torch.Tensor,  # [rows, k_max + 1, vocab]
    num_proposed: torch.Tensor,  # [rows] int64
    u_accept: torch.Tensor,  # [rows, k_max] fp64, the draw of each acceptance test
    u_next: torch.Tensor,  # [rows, k_max + 1] fp64, the draw of the next token after a accepted
) -> Acceptance:
    rows, k_max = draft_tokens.shape
    if k_max:
        index = draft_tokens[..., None]
        p = target_probs[:, :k_max].gather(-1, index).squeeze(-1)
        q = draft_probs.gather(-1, index).squeeze(-1)
        valid = torch.arange(k_max)[None, :] < num_proposed[:, None]
        ok = (u_accept * q < p) & valid  # u < p / q without dividing by a zero q
        num_accepted = ok.long().cumprod(-1).sum(-1)
    else:
        num_accepted = torch.zeros(rows, dtype=torch.int64)
    row = torch.arange(rows)
    next_dist = target_probs[row, num_accepted]  # [rows, vocab]
    rejected = num_accepted < num_proposed
    if bool(rejected.any()):
        q_at = draft_probs[row, num_accepted.clamp(max=max(k_max - 1, 0))]
        residual = (next_dist - q_at).clamp_(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q leaves no residual mass; sampling p is then exact.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), next_dist)
        next_dist = torch.where(rejected[:, None], residual, next_dist)
    u = u_next.gather(1, num_accepted[:, None]).squeeze(1)
    return Acceptance(num_accepted.tolist(), sample(next_dist, u).tolist())
