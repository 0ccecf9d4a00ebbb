"""What speculation needs of the executor's runners, as protocols.

The proposers, the verifier and calibration run models only through these;
the executor's ModelRunner and HeadRunner (specpage/executor/) satisfy them
by their shape, so speculation never imports the executor, which builds
and calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specpage.core.span import Span
from specpage.models.decoder import LayerTap


class SpanRunner(Protocol):
    """A model's KV over the pool's blocks and a forward over spans: what
    the draft proposer runs and calibration times."""

    @property
    def block_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def group_count(self) -> int:
        """Block tables a span carries (core/layer_groups.py): 1, or more."""
        ...

    def forward(self, spans: Sequence[Span]) -> torch.Tensor:
        """fp32 logits [sum of num_logits, vocab], spans in order."""
        ...


class TargetRunner(Protocol):
    """The target's forward, which can also hand a tap the hidden states
    entering the layers it names (a draft head's features)."""

    def forward(self, spans: Sequence[Span], tap: LayerTap | None = None) -> torch.Tensor: ...


class DraftHead(Protocol):
    """An EAGLE-3 head's forwards (executor/head_runner.py): the layer over
    spans from hidden states, its logits, and the target's taps projected."""

    @property
    def block_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def tap_width(self) -> int:
        """A position's tapped target states, concatenated."""
        ...

    def run(self, spans: Sequence[Span], hidden: torch.Tensor,
            every_output: bool = False) -> torch.Tensor: ...

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor: ...

    def features(self, taps: torch.Tensor) -> torch.Tensor: ...
