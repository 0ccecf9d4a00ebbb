"""Whether model-free proposals pay, as the steps that ran them measured it.

The policy prices a model-free proposal with the target's cost curve
(core/policy.py), and the curve can be wrong where it matters most: at a
large batch on a CPU every verified position costs nearly what a token
does, and a curve whose slope is off by a third turns a 3% gain into a 10%
loss. So the outcome is measured as well, per batch size class (a power of
two): each decoding step's tokens per sequence over its seconds against
the curve's price of a plain step at its batch (which makes steps of
different batches in a class comparable), decayed, separately for steps
in which some sequence verified a model-free proposal and steps in which
none did. Where the first fall short of the second by more than TOLERANCE,
the class goes without model-free proposals but for one step in
PROBE_EVERY, which keeps measuring; where they are on, one step in
PROBE_EVERY (PROBE_RARELY where they clearly pay) goes without them, so
that both kinds stay measured.

Pure Python; no torch.
"""

from __future__ import annotations

DECAY = 0.95  # per observed step of a kind, in its class
LEAST = 8.0  # decayed steps of each kind before a class is judged
TOLERANCE = 0.02  # the share by which model-free steps may fall short
PROBE_EVERY = 16  # steps of a class between steps of the other kind
# Where model-free steps are CLEAR_MARGIN better than plain ones, plain
# steps are measured only one step in PROBE_RARELY: each costs the class
# what the margin is worth (docs/BENCHMARKS.md, "The payoff's probes").
CLEAR_MARGIN = 1.25
PROBE_RARELY = 64


class Outcomes:
    """One batch class: decayed efficiency sums and weights, by kind."""

    __slots__ = ("sums", "weights", "steps")

    def __init__(self) -> None:
        self.sums = [0.0, 0.0]  # index: whether a model-free proposal was verified
        self.weights = [0.0, 0.0]
        self.steps = 0

    def observe(self, model_free: bool, efficiency: float) -> None:
        kind = int(model_free)
        self.sums[kind] = self.sums[kind] * DECAY + efficiency
        self.weights[kind] = self.weights[kind] * DECAY + 1.0

    @property
    def gain(self) -> float:
        """Model-free steps' efficiency over plain ones' (1 until both are measured)."""
        if min(self.weights) < LEAST:
            return 1.0
        plain, model_free = (s / w for s, w in zip(self.sums, self.weights, strict=True))
        return model_free / max(plain, 1e-12)

    @property
    def pays(self) -> bool:
        """Model-free steps are no worse than plain ones, or not yet judged."""
        return self.gain >= 1 - TOLERANCE

    @property
    def probe_every(self) -> int:
        return PROBE_RARELY if self.gain >= CLEAR_MARGIN else PROBE_EVERY


class Payoff:
    def __init__(self) -> None:
        self.classes: dict[int, Outcomes] = {}
        # per batch, until the next step is observed: every sequence of a
        # step asks
        self._allowed: dict[int, bool] = {}

    def allows(self, batch: int) -> bool:
        """Whether this step may verify model-free proposals at this batch."""
        allowed = self._allowed.get(batch)
        if allowed is None:
            outcomes = self._class(batch)
            every = outcomes.probe_every
            probing = outcomes.steps % every == every - 1
            allowed = self._allowed[batch] = outcomes.pays != probing
        return allowed

    def observe(self, batch: int, model_free: bool, tokens: int, seconds: float,
                plain_seconds: float) -> None:
        """A decoding step of `batch` sequences that made `tokens` tokens in
        `seconds`, where a plain step at that batch is priced plain_seconds."""
        self._allowed.clear()
        outcomes = self._class(batch)
        outcomes.steps += 1
        if batch > 0 and seconds > 0 and plain_seconds > 0:
            outcomes.observe(model_free, (tokens / batch) / (seconds / plain_seconds))

    def _class(self, batch: int) -> Outcomes:
        size = max(batch, 1).bit_length()
        outcomes = self.classes.get(size)
        if outcomes is None:
            outcomes = self.classes[size] = Outcomes()
        return outcomes
