"""Speculative sampling with an EAGLE-3 head as the draft keeps the target's
distribution: the chi-square test of tests/speculation/test_sampling.py, with a
random head (whole vocabulary, or part of it through d2t) in place of the
draft model."""

import pytest

from specpage.core.request import SamplingParams
from specpage.models.loader import load_model
from tests.speculation.test_sampling import (
    ALPHA,
    RUNS,
    VOCAB,
    chi_square_p,
    exact_joint,
    peaked_model,
    sampled_joint,
)
from tests.support.head import tiny_head


@pytest.mark.parametrize("draft_vocab", [None, [0, 2, 3, 5]], ids=["whole", "reduced"])
def test_sampling_with_a_head_preserves_the_target_distribution(tmp_path, draft_vocab):
    params = SamplingParams(temperature=1.0)
    target_hf = peaked_model(tmp_path / "t", seed=0)
    # the one-layer target's only layer, three times; a peaked head differs from it
    tiny_head(tmp_path / "h", target_hf.config, seed=3, draft_vocab=draft_vocab, scale=30.0,
              hidden_size=32, eagle_aux_hidden_state_layer_ids=[0, 0, 0])
    target, head = load_model(tmp_path / "t"), load_model(tmp_path / "h")
    exact = exact_joint(target_hf, params)
    proposed = []
    speculative, engine = sampled_joint(target, head, params, proposed)
    stats = engine.stats()
    assert stats.drafted_tokens > RUNS and 0 < stats.accepted_tokens < stats.drafted_tokens
    assert chi_square_p(speculative, exact) > ALPHA
    if draft_vocab is not None:
        assert set(proposed) <= set(draft_vocab)
        outside = [x2 * VOCAB + x3 for x2 in range(VOCAB) for x3 in range(VOCAB)
                   if x2 not in draft_vocab or x3 not in draft_vocab]
        assert speculative[outside].sum() > 0.1 * RUNS
