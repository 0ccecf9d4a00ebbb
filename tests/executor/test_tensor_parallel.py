"""Tensor parallelism (specpage.executor.parallel) on tiny checkpoints: two ranks
(gloo, two processes on loopback) give the greedy tokens one rank and
transformers give, with speculation on and off, across mixed batches,
prefix-cache hits and preemption; and logits that agree within
LOGIT_TOLERANCE (an all-reduce sums in another order than one matmul).

The checkpoints' heads divide by 2 (GQA with biases everywhere, and MHA
with a tied embedding); their vocabulary projection is scaled so the top
two logits stand far apart and no summation order can swap them."""

from __future__ import annotations

import random

import pytest
import torch

from specpage.core.config_error import ConfigError
from specpage.core.request import SamplingParams
from specpage.core.span import Span
from specpage.engine import Engine, EngineConfig
from specpage.executor.model_runner import ModelRunner
from specpage.executor.parallel.sharding import check_divisible
from specpage.models.config import ModelConfig
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint

VOCAB = 212  # divides by 2
HEAD_SCALE = 6.0  # the vocabulary projection's weights, times this
# |logits at 2 ranks - at 1 rank|, fp32; measured about 2e-6 on logits of magnitude ~10
LOGIT_TOLERANCE = 1e-4
MIN_MARGIN = 100 * LOGIT_TOLERANCE  # top-2 logit gap along every greedy continuation
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, n=2,
                         ignore_eos=True)
CHECKPOINTS = {  # name -> tiny_checkpoint arguments
    "gqa": dict(family="llama", num_attention_heads=4, num_key_value_heads=2,
                attention_bias=True, mlp_bias=True),
    "mha": dict(family="qwen2", num_attention_heads=4, num_key_value_heads=4,
                tie_word_embeddings=True),
}


def checkpoint(folder, **options):
    hf = tiny_checkpoint(folder, vocab_size=VOCAB, **options)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(HEAD_SCALE)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    made = {name: checkpoint(root / name, **options) for name, options in CHECKPOINTS.items()}
    tiny_checkpoint(root / "draft", seed=1, num_hidden_layers=1, vocab_size=VOCAB)
    return root, made


def engine(models, name, ranks, draft=True, **config):
    root, _ = models
    options = dict(block_size=4, num_blocks=24, spec_k=3 if draft else 0, adaptive_k=False,
                   max_step_tokens=24, tensor_parallel_size=ranks)
    options.update(config)
    return Engine(load_model(root / name), load_model(root / "draft") if draft else None, None,
                  EngineConfig(**options))


def prompts(count, seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(lengths[i % len(lengths)])]
            for i in range(count)]


def drain(eng, arrivals):
    """Step until idle; arrivals: step -> [(id, prompt, params)]; returns
    {(id, sample): tokens}."""
    arrivals, results, step = dict(arrivals), {}, 0
    while eng.has_unfinished() or arrivals:
        for request_id, prompt, params in arrivals.pop(step, []):
            eng.add_request(request_id, prompt, params)
        for out in eng.step():
            key = (out.request_id, out.index)
            results[key] = results.get(key, []) + out.token_ids
        step += 1
        assert step < 2000
    eng.pool.check_integrity()
    return results


def hf_greedy(hf, prompt, max_new):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def workload():
    """Requests joining at steps 0, 2 and 5 (prefill chunks beside decodes),
    one of two seeded samples (its blocks forked), then two sharing a
    33-token prefix, the second after the first ended (a prefix-cache hit)."""
    batch = prompts(8, seed=3, lengths=(9, 14, 6, 22))
    arrivals: dict[int, list] = {0: [], 2: [], 5: []}
    for i, p in enumerate(batch):
        arrivals[(0, 2, 5)[i % 3]].append((str(i), p, GREEDY))
    arrivals[2].append(("sampled", batch[0], SAMPLED))
    shared = prompts(1, seed=4, lengths=(33,))[0]
    return batch, arrivals, [("a", shared + [1, 2, 3]), ("b", shared + [7, 8])]


def run(eng, arrivals, prefixed):
    results = drain(eng, arrivals)
    for request_id, prompt in prefixed:
        results.update(drain(eng, {0: [(request_id, prompt, GREEDY)]}))
    return results, eng.stats()


@pytest.mark.parametrize(("name", "draft"), [("gqa", True), ("gqa", False), ("mha", True)])
def test_two_ranks_give_one_ranks_and_transformers_greedy_tokens(models, name, draft):
    hf = models[1][name]
    batch, arrivals, prefixed = workload()
    one, one_stats = run(engine(models, name, 1, draft), arrivals, prefixed)
    two_ranks = engine(models, name, 2, draft)
    try:
        two, stats = run(two_ranks, arrivals, prefixed)
    finally:
        two_ranks.close()
    assert two == one
    for i, prompt in enumerate(batch):
        assert two[(str(i), 0)] == hf_greedy(hf, prompt, 16), i
    for request_id, prompt in prefixed:
        assert two[(request_id, 0)] == hf_greedy(hf, prompt, 16), request_id
    assert stats.preemptions == one_stats.preemptions > 0  # 24 blocks of 4 hold too few
    assert stats.prefix_cached_tokens == one_stats.prefix_cached_tokens >= 32
    assert (stats.drafted_tokens > 0) == draft
    assert len(two[("sampled", 1)]) == 12


def test_logits_agree_within_tolerance_and_margins_dwarf_it(models):
    root, made = models
    hf = made["gqa"]
    prompt = prompts(1, seed=9, lengths=(13,))[0]
    generated = hf_greedy(hf, prompt, 16)
    tokens = prompt + generated[:-1]
    # the prompt in two chunks, then one decode token at a time
    spans = [Span(tokens[:8], 0, [0, 1, 2, 3, 4, 5, 6, 7], 8),
             Span(tokens[8:13], 8, [0, 1, 2, 3, 4, 5, 6, 7], 5)]
    spans += [Span([t], 13 + i, [0, 1, 2, 3, 4, 5, 6, 7], 1)
              for i, t in enumerate(tokens[13:])]
    whole = ModelRunner(load_model(root / "gqa"), 24, 4)
    two_ranks = engine(models, "gqa", 2, draft=False)
    try:
        leader = two_ranks.executor.target
        ours = [(whole.forward([s]), leader.forward([s])) for s in spans]
    finally:
        two_ranks.close()
    one = torch.cat([a for a, _ in ours])
    two = torch.cat([b for _, b in ours])
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0].float()
    assert two.shape == one.shape == reference.shape == (len(tokens), VOCAB)
    assert (two - one).abs().max() < LOGIT_TOLERANCE
    assert (two - reference).abs().max() < LOGIT_TOLERANCE
    top2 = reference.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN
    assert two[len(prompt) - 1:].argmax(-1).tolist() == generated


def test_sizes_that_do_not_divide_name_the_numbers(models):
    root, _ = models
    config = ModelConfig.from_folder(root / "gqa")
    with pytest.raises(ConfigError) as error:
        check_divisible(config, 3)
    assert str(error.value) == (
        "engine.tensor_parallel_size 3 does not divide the target's attention heads (4), "
        "KV heads (2), vocabulary (212); sizes that do: 1, 2")
    with pytest.raises(ConfigError, match="tensor_parallel_size must be > 0"):
        EngineConfig(tensor_parallel_size=0)
