"""Penalties, min-p, logit bias and min_tokens through the engine on tiny
random fp32 checkpoints: greedy output with speculation (the suffix cache
proposing an earlier request's output, or a draft model) equals speculation off and
transformers' logits adjusted by the reference in
tests/speculation/test_penalties.py, and seeded sampling with a draft
model fits the exact adjusted distribution."""

from collections import Counter

import msgspec
import pytest
import torch

from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from tests.engine.test_engine import drain, engine
from tests.speculation.test_model_free_engine import routed
from tests.speculation.test_penalties import (
    ADJUSTED,
    GREEDY,
    PROMPTS,
    SAMPLED,
    exact_pairs,
    hf_decode,
    spread_model,
)
from tests.speculation.test_sampling import ALPHA, VOCAB, chi_square_p
from tests.support.checkpoints import target_and_draft


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_draft(tmp_path_factory.mktemp("models"))


def arrivals(params, method="suffix"):
    """PROMPTS as requests whose sequences propose by `method` (routed),
    then again once they are done: the suffix cache then proposes their
    first output, with its history adjusted at every verified row."""
    first = [(f"{method}-{i}", p, params) for i, p in enumerate(PROMPTS)]
    again = [(f"{method}-{i + len(PROMPTS)}", p, params) for i, p in enumerate(PROMPTS)]
    return {0: first, 60: again}


def outputs(results):
    return [results[key][0] for key in sorted(results, key=lambda k: int(k[0].split("-")[1]))]


@pytest.mark.parametrize("adjust", list(ADJUSTED), ids=list(ADJUSTED))
def test_greedy_speculation_equals_speculation_off_and_transformers(models, adjust):
    hf = models[0]
    params = msgspec.structs.replace(GREEDY, max_tokens=20, **ADJUSTED[adjust])
    off = outputs(drain(engine(models, None, spec_k=0), arrivals(params)))
    assert off == [hf_decode(hf, p, params, 20) for p in PROMPTS] * 2
    suffix = routed(engine(models, None, spec_methods="suffix"))
    assert outputs(drain(suffix, arrivals(params))) == off
    assert suffix.stats().by_method["suffix"].accepted > 0
    drafted = routed(engine(models, "draft"))
    assert outputs(drain(drafted, arrivals(params, "draft"))) == off
    assert drafted.stats().by_method["draft"].drafted > 0


def test_min_tokens_holds_eos_back_with_speculation(models):
    eos = models[1].config.eos_token_ids[0]
    params = msgspec.structs.replace(GREEDY, max_tokens=12, ignore_eos=False, min_tokens=5,
                                     logit_bias={eos: 100.0})
    off = drain(engine(models, None, spec_k=0), arrivals(params))
    for tokens, reason in off.values():
        assert eos not in tokens[:5]
        assert (tokens[5:], reason) == ([eos], "stop")
    suffix = routed(engine(models, None, spec_methods="suffix"))
    assert drain(suffix, arrivals(params)) == off
    assert suffix.stats().by_method["suffix"].accepted > 0


RUNS = 4000


@pytest.mark.parametrize("name", list(SAMPLED), ids=list(SAMPLED))
def test_speculative_sampling_fits_the_adjusted_distribution(tmp_path, name):
    """A draft model's q, rejection sampling against the adjusted p."""
    target_hf = spread_model(tmp_path / "t", seed=0)
    spread_model(tmp_path / "d", seed=1)
    prompt = [1, 2, 3, 2, 1]
    params = SAMPLED[name]
    exact = exact_pairs(target_hf, params, prompt)
    eng = Engine(load_model(tmp_path / "t"), load_model(tmp_path / "d"), None, EngineConfig(
        block_size=4, num_blocks=4096, max_num_seqs=256, max_step_tokens=2048, spec_k=2,
        adaptive_k=False, spec_methods=""))
    for seed in range(RUNS):
        eng.add_request(str(seed), prompt, msgspec.structs.replace(
            params, max_tokens=4, seed=seed, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    # the first token from the prefill, the second from the first verification
    counts = Counter(tokens[0] * VOCAB + tokens[1] for tokens in outputs.values())
    observed = torch.tensor([counts[i] for i in range(VOCAB * VOCAB)], dtype=torch.float64)
    stats = eng.stats()
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert chi_square_p(observed, exact) > ALPHA


def test_neutral_parameters_carry_nothing_to_the_executor(models):
    """Defaults build no adjustments: the verifier's rows stay as they were."""
    eng = engine(models, None, spec_k=0)
    eng.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2))
    batch = eng.core.schedule()
    assert [w.sampling.adjustments for w in batch.seqs] == [None]
    assert [w.sampling.min_p for w in batch.seqs] == [0.0]
    eng.core.apply(eng.executor.execute(batch))
