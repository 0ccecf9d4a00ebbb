"""The speculative engine on tiny random checkpoints: exactness against
transformers, seeded reproducibility, forks, preemption, aborts, prefix cache."""

import json
import math
import random

import pytest
import torch

from specpage.core.model_free import Speculation
from specpage.core.request import SamplingParams, ValidationError
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import ModelLoadError, load_model
from tests.support.checkpoints import target_and_draft, tiny_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_draft(tmp_path_factory.mktemp("models"))


def engine(models, draft="draft", **config):
    _, target, other = models
    draft_model = {"draft": other, "self": target, None: None}[draft]
    # the draft's own rules; tests/speculation/test_model_free_engine.py adds the proposers
    # that need no model
    options = dict(block_size=4, num_blocks=512, spec_k=3, adaptive_k=False, spec_methods="")
    options.update(config)
    return Engine(target, draft_model, None, EngineConfig(**options))


def drain(eng, arrivals=None, abort_at=None):
    """Step until idle. arrivals: step -> [(id, prompt, params)]; returns
    {(id, sample): (tokens, finish_reason)}."""
    arrivals = dict(arrivals or {})
    results, step = {}, 0
    while eng.has_unfinished() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.pop(step, []):
            eng.add_request(request_id, prompt, params)
        for request_id in (abort_at or {}).get(step, []):
            eng.abort(request_id)
        for out in eng.step():
            tokens, _ = results.get((out.request_id, out.index), ([], None))
            results[(out.request_id, out.index)] = (tokens + out.token_ids, out.finish_reason)
        step += 1
        assert step < 5000
    eng.pool.check_integrity()
    assert eng.pool.stats().in_use == 0
    return results


def prompts(count, seed=0, lengths=(3, 11, 22, 17, 40, 5)):
    rng = random.Random(seed)
    return [[rng.randrange(1, 211) for _ in range(lengths[i % len(lengths)])]
            for i in range(count)]


def hf_greedy(hf, prompt, max_new):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft", ["draft", "self", None])
def test_greedy_speculation_equals_transformers(models, draft):
    hf = models[0]
    batch = prompts(6)
    # requests join at different steps, with chunked prefill under a small budget
    arrivals = {0: [], 2: [], 5: []}
    for i, p in enumerate(batch):
        arrivals[(0, 2, 5)[i % 3]].append((str(i), p, GREEDY))
    eng = engine(models, draft, max_step_tokens=24)
    results = drain(eng, arrivals)
    for i, p in enumerate(batch):
        tokens, reason = results[(str(i), 0)]
        assert tokens == hf_greedy(hf, p, 16), i
        assert reason == "length"
    stats = eng.stats()
    if draft == "self":
        assert stats.acceptance == stats.per_token_acceptance == 1.0
        assert stats.drafted_tokens > 0
    if draft is None:
        assert stats.drafted_tokens == 0


def test_adaptive_k_keeps_greedy_output_exact(models):
    batch = prompts(6)
    plain = drain(engine(models, None), {0: [(str(i), p, GREEDY) for i, p in enumerate(batch)]})
    eng = engine(models, "draft", adaptive_k=True, spec_k=4)
    assert drain(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(batch)]}) == plain


def sampled(seed, **kw):
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=seed,
                          ignore_eos=True, **kw)


def test_seeded_sampling_ignores_the_rest_of_the_batch(models):
    alone = drain(engine(models), {0: [("a", prompts(1)[0], sampled(7))]})
    others = [(f"o{i}", p, sampled(100 + i)) for i, p in enumerate(prompts(5, seed=3))]
    crowded = drain(engine(models), {0: others[:3], 1: [("a", prompts(1)[0], sampled(7))],
                                     3: others[3:]})
    assert crowded[("a", 0)] == alone[("a", 0)]
    # and with speculation off the seeded output is the same on every run
    assert drain(engine(models, None), {0: [("a", prompts(1)[0], sampled(7))]}) == drain(
        engine(models, None), {0: [("a", prompts(1)[0], sampled(7))]})


def test_n_samples_fork_the_prompt_blocks_and_match_seeds_run_alone(models):
    prompt = prompts(1, lengths=(30,))[0]
    eng = engine(models)
    eng.add_request("n", prompt, sampled(40, n=4))
    first = {o.index: o.token_ids for o in eng.step()}  # prefill, then fork
    assert sorted(first) == [0, 1, 2, 3]
    stats = eng.pool.stats()
    # 30 prompt tokens = 7 full blocks shared by all four + each sample's own tail
    assert len({eng.pool.block_table(s.seq_id)[:7] for s in eng.requests["n"].sequences}) == 1
    assert stats.in_use < 4 * 8
    results = drain(eng)
    for i in range(4):
        alone = drain(engine(models), {0: [("x", prompt, sampled(40 + i))]})
        assert first[i] + results[("n", i)][0] == alone[("x", 0)][0], i


@pytest.mark.parametrize("params", [GREEDY, sampled(11)])
def test_preemption_under_a_tiny_pool_keeps_outputs(models, params):
    batch = prompts(8, lengths=(9, 14, 6))
    arrivals = {0: [(str(i), p, params) for i, p in enumerate(batch)]}
    roomy = drain(engine(models), arrivals)
    tiny = engine(models, num_blocks=24)
    assert drain(tiny, arrivals) == roomy
    assert tiny.stats().preemptions > 0


def test_random_aborts_across_500_requests_leak_nothing(models):
    rng = random.Random(5)
    arrivals, aborts = {}, {}
    for i in range(500):
        step = rng.randrange(60)
        params = GREEDY if i % 2 else sampled(i, n=rng.choice([1, 1, 2]))
        arrivals.setdefault(step, []).append((str(i), prompts(1, seed=i)[0], params))
        if rng.random() < 0.5:
            aborts.setdefault(step + rng.randrange(8), []).append(str(i))
    eng = engine(models, num_blocks=160, max_num_seqs=32)
    results = drain(eng, arrivals, aborts)
    reasons = {r for _, r in results.values()}
    assert reasons <= {"length", "abort"} and "abort" in reasons
    assert not eng.requests  # every request ended and was let go
    stats = eng.pool.stats()
    assert stats.free + stats.cached == stats.total


def test_prefix_cache_hits_give_the_same_output_with_less_prefill(models):
    shared = prompts(1, lengths=(33,))[0]
    cold = drain(engine(models), {0: [("b", shared + [7, 8], GREEDY)]})
    eng = engine(models)
    drain(eng, {0: [("a", shared + [1, 2, 3], GREEDY)]})
    assert eng.stats().prefix_cached_tokens == 0
    warm = drain(eng, {0: [("b", shared + [7, 8], GREEDY)]})
    assert warm == cold
    assert eng.stats().prefix_cached_tokens == 32  # 8 full blocks of 4


def test_deadline_drops_the_request_and_frees_its_blocks(models):
    eng = engine(models)
    eng.add_request("late", prompts(1)[0], GREEDY, deadline=0.0)
    eng.add_request("fine", prompts(1)[0], GREEDY)
    outputs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished][0] == (
        "late", "timeout")
    results = drain(eng)
    assert results[("fine", 0)][1] == "length"


def test_stop_token_ids_and_max_tokens(models):
    hf = models[0]
    prompt = prompts(1)[0]
    expected = hf_greedy(hf, prompt, 16)
    stop = expected[5]
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop,), ignore_eos=True)
    results = drain(engine(models, "self"), {0: [("s", prompt, params)]})
    assert results[("s", 0)] == (expected[: expected.index(stop) + 1], "stop")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(n=0), "n"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(stop_token_ids=(3, 211)), "stop_token_ids"),  # the vocabulary is 211
    ],
)
def test_invalid_parameters_name_the_field(models, params, field):
    eng = engine(models)
    with pytest.raises(ValidationError) as error:
        eng.add_request("bad", [1, 2, 3], params)
    assert error.value.field == field and field in str(error.value)
    assert not eng.has_unfinished()


def test_bad_prompts_name_the_field(models):
    eng = engine(models)
    for prompt, field in (([], "prompt"), ([1] * 600, "prompt"), ([5, 211], "prompt"),
                          ("text", "prompt")):
        with pytest.raises(ValidationError) as error:
            eng.add_request("bad", prompt, GREEDY)
        assert error.value.field == field
    with pytest.raises(ValidationError, match="max_tokens"):
        engine(models, num_blocks=8).add_request("big", [1] * 20, SamplingParams(max_tokens=100))
    eng.add_request("ok", [1, 2], GREEDY)
    with pytest.raises(ValidationError, match="already running"):
        eng.add_request("ok", [1, 2], GREEDY)


def test_the_step_budget_must_hold_a_decoding_span(models):
    with pytest.raises(ValueError, match="spec_k \\+ 2"):
        engine(models, spec_k=4, max_step_tokens=5)


def test_logprobs_cover_every_token_of_every_sample(models):
    hf = models[0]
    prompt = prompts(1)[0]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=True,
                            ignore_eos=True)
    eng = engine(models)
    eng.add_request("lp", prompt, params)
    tokens, logprobs = {0: [], 1: []}, {0: [], 1: []}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.index] += out.token_ids
            logprobs[out.index] += out.logprobs or []
    for index in (0, 1):
        assert len(logprobs[index]) == len(tokens[index]) == 6
        ids = torch.tensor([prompt + tokens[index]])
        with torch.no_grad():
            expected = torch.log_softmax(hf(ids).logits[0], -1)
        for j, token in enumerate(tokens[index]):
            assert abs(expected[len(prompt) - 1 + j, token] - logprobs[index][j]) < 1e-4


def test_forked_samples_count_against_max_num_seqs(models):
    eng = engine(models, max_num_seqs=4)
    with pytest.raises(ValidationError, match="n"):
        eng.add_request("big", prompts(1)[0], sampled(1, n=5))
    for i in range(3):
        eng.add_request(str(i), prompts(1, seed=i)[0], sampled(i, n=3))
    most = 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, len(eng.scheduler.running))
    assert most <= 4


def test_the_draft_catches_up_after_steps_without_speculation(models):
    """While k = 0 the draft does not run; when speculation resumes it first
    computes the tokens it missed. With the target as its own draft every
    proposal is then accepted, which it could not be over stale KV."""
    hf = models[0]
    eng = engine(models, draft="self", spec_k=3, adaptive_k=True)
    forwards = []
    runner = eng.executor.proposer.runner
    runner_forward = runner.forward
    runner.forward = lambda spans: forwards.append(spans) or runner_forward(spans)
    steps = iter([0] * 7 + [3, 0, 0, 3, 3, 0] * 20)
    eng.scheduler.speculate = lambda seq, batch: Speculation(next(steps))
    batch = prompts(2, seed=5)
    results = drain(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(batch)]})
    for i, p in enumerate(batch):
        assert results[(str(i), 0)][0] == hf_greedy(hf, p, 16)
    stats = eng.stats()
    assert stats.drafted_tokens > 0 and stats.per_token_acceptance == 1.0
    # the first draft forward covered everything it had missed
    assert max(len(s.token_ids) for s in forwards[0]) > 7


def test_speculation_off_costs_no_draft_forward(models):
    eng = engine(models, draft="draft", spec_k=3)
    eng.scheduler.speculate = lambda seq, batch: Speculation(0)
    calls = []
    eng.executor.proposer.runner.forward = lambda spans: calls.append(spans)
    drain(eng, {0: [("a", prompts(1)[0], GREEDY)]})
    assert calls == []


def test_a_prefix_cache_hit_recomputes_the_drafts_kv(models):
    """Cached blocks vouch for the target's KV only: the second request's
    draft computes the shared prefix itself, so self-drafting stays exact."""
    eng = engine(models, draft="self", spec_k=3)
    prompt = prompts(1, seed=9, lengths=(30,))[0]
    first = drain(eng, {0: [("a", prompt, GREEDY)]})
    second = drain(eng, {0: [("b", prompt, GREEDY)]})
    assert eng.stats().prefix_cached_tokens > 0
    assert first[("a", 0)] == second[("b", 0)]
    assert eng.stats().per_token_acceptance == 1.0


def test_a_restricted_draft_vocabulary_keeps_greedy_output_exact(tmp_path):
    """The target as its own draft, but proposing only from the tokens in its
    draft_vocab.json: proposals stay inside that list, the ones the target
    would not pick are rejected, and the output is still the target's."""
    hf = tiny_checkpoint(tmp_path / "target")
    tiny_checkpoint(tmp_path / "draft")  # the same weights
    allowed = list(range(0, 211, 2))
    (tmp_path / "draft" / "draft_vocab.json").write_text(json.dumps({"token_ids": allowed}))
    target, draft = load_model(tmp_path / "target"), load_model(tmp_path / "draft")
    eng = Engine(target, draft, None, EngineConfig(block_size=4, num_blocks=512, spec_k=3,
                                                   adaptive_k=False))
    proposed = []
    proposer = eng.executor.proposer
    propose = proposer.propose
    proposer.propose = (lambda batch, guides: proposed.append(propose(batch, guides))
                        or proposed[-1])
    batch = prompts(4, seed=3)
    results = drain(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(batch)]})
    for i, p in enumerate(batch):
        assert results[(str(i), 0)][0] == hf_greedy(hf, p, 16)
    tokens = {t for proposal in proposed for seq in proposal.tokens for t in seq}
    assert tokens and tokens <= set(allowed)
    stats = eng.stats()
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("content", ['{"token_ids": []}', '{"token_ids": [1, 211]}',
                                     '{"ids": [1]}', "not json"])
def test_a_bad_draft_vocabulary_names_the_file(tmp_path, content):
    tiny_checkpoint(tmp_path / "target")
    tiny_checkpoint(tmp_path / "draft", seed=1)
    (tmp_path / "draft" / "draft_vocab.json").write_text(content)
    target, draft = load_model(tmp_path / "target"), load_model(tmp_path / "draft")
    with pytest.raises(ModelLoadError, match="draft_vocab.json"):
        Engine(target, draft, None, EngineConfig(block_size=4, num_blocks=64))


def test_forward_costs_reach_the_policy_without_prefill_steps(models):
    """The target's cost fit sees decode and verify forwards only (a prompt's
    positions cost more each); the draft's sees every forward with its
    positions."""
    eng = engine(models, draft="draft", spec_k=2)
    eng.add_request("a", prompts(1, lengths=(40,))[0], GREEDY)
    eng.step()  # the whole prompt
    assert eng.policy.target_cost.observations == 0
    results = []
    execute = eng.executor.execute
    eng.executor.execute = (lambda batch, guides=None: results.append(execute(batch, guides))
                             or results[-1])
    while not any(r.draft_costs for r in results):
        eng.step()
    # the first draft run catches up over the prompt, then proposes one position
    assert [n for n, _ in results[-1].draft_costs] == [41, 1]
    while eng.has_unfinished():
        eng.step()
    assert eng.policy.target_cost.observations > 0
    assert eng.policy.draft_cost.observations > 2
