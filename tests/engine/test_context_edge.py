"""Requests that end at the context's edge: for every distance between the
prompt's end and the context's end from 0 to a few proposals past k, a
greedy request gets exactly the tokens that fit, with finish reason
`length`, and leaves no block behind. With a draft model, an EAGLE-3 head
and no draft (model-free proposals), in fp32, bf16 and q4, speculation
chosen by the policy and forced on.

The tiny models' vocabulary is a multiple of 16, as a real model's is, so
that in bf16 and q4 the vocabulary projection runs on the native few-row
kernels (tests/support/checkpoints.py's 211 keeps it off them). Each case also runs
with a step budget below the prompt: its chunks that stop short of the
newest token want no logits, and a forward that wants none must not project
zero rows (bf16_gemv takes 1 to 16). A last case preempts a sequence near
the edge, so it is recomputed there: a head's recompute stops one short of
its newest token (core/proposer_rules.py's HEAD.trim)."""

from __future__ import annotations

import random

import pytest
import torch

from specpage.core.request import SamplingParams, ValidationError
from specpage.core.span import Span
from specpage.engine import Engine, EngineConfig
from specpage.executor.model_runner import ModelRunner
from tests.support.checkpoints import models_by_dtype, tiny_checkpoint
from tests.support.head import tiny_head

K = 3  # the engine's proposals at most, and a forced request's k
MAX_CONTEXT = 40
# 0 (the prompt fills the context: refused) .. k + 2, and a few more
DISTANCES = (*range(K + 3), 8, 13)
VOCAB = 256  # a multiple of 16: the native few-row kernels take the vocabulary projection
TAPS = [0, 1, 2]  # the target's three layers
DTYPES = ("fp32", "bf16", "q4")
DRAFTS = ("draft", "head", None)
GREEDY = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge")
    hf = tiny_checkpoint(root / "target", num_hidden_layers=3, vocab_size=VOCAB)
    tiny_checkpoint(root / "draft", seed=1, num_hidden_layers=1, vocab_size=VOCAB)
    # intermediate_size 96: shapes q4 takes (inputs in groups of 32)
    tiny_head(root / "head", hf.config, intermediate_size=96,
              eagle_aux_hidden_state_layer_ids=TAPS)
    return root


@pytest.fixture(scope="module")
def loaded(root):
    """Each dtype's models, loaded once: {dtype: (target, {draft: model})}."""
    return models_by_dtype(root)


def make_engine(loaded, dtype: str, draft: str | None, **config) -> Engine:
    target, drafts = loaded(dtype)
    options = dict(block_size=4, num_blocks=64, spec_k=K, max_context=MAX_CONTEXT)
    options.update(config)
    return Engine(target, drafts[draft] if draft else None, None, EngineConfig(**options))


def prompt_for(distance: int) -> list[int]:
    """A prompt that leaves `distance` positions of the context, repeating
    itself so that the model-free proposers find continuations in it."""
    rng = random.Random(distance)
    base = [rng.randrange(1, VOCAB) for _ in range(5)]
    return (base * MAX_CONTEXT)[: MAX_CONTEXT - distance]


def run(eng: Engine, request_id: str, prompt: list[int], spec_k: int | None):
    """One request to its end alone; (tokens, finish_reason), the pool checked."""
    request = eng.make_request(request_id, prompt, GREEDY)
    request.spec_k = spec_k
    eng.submit(request)
    tokens, reason = [], None
    for _ in range(10 * MAX_CONTEXT):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            tokens += out.token_ids
            if out.finished:
                reason = out.finish_reason
    assert not eng.has_unfinished() and not eng.requests
    check_pool(eng)
    return tokens, reason


def check_pool(eng: Engine) -> None:
    eng.pool.check_integrity()
    stats = eng.pool.stats()
    assert stats.in_use == 0 and stats.tentative == 0, stats
    assert stats.free + stats.cached == stats.total, stats


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_forward_that_wants_no_logits_projects_nothing(loaded, dtype):
    """A prefill chunk alone in its forward: its K/V written, no logits."""
    target, _ = loaded(dtype)
    runner = ModelRunner(target, num_blocks=8, block_size=4)
    logits = runner.forward([Span(prompt_for(30)[:6], 0, [0, 1], num_logits=0)])
    assert logits.shape == (0, VOCAB) and logits.dtype == torch.float32
    assert runner.forward([Span([7], 6, [0, 1])]).shape == (1, VOCAB)


@pytest.fixture(scope="module")
def plain(loaded):
    """Each dtype's greedy tokens without speculation, by distance."""
    cache: dict = {}

    def get(dtype: str) -> dict[int, list[int]]:
        if dtype not in cache:
            eng = make_engine(loaded, dtype, None, spec_k=0, spec_methods="")
            cache[dtype] = {d: run(eng, f"plain{d}", prompt_for(d), None)[0]
                            for d in DISTANCES if d}
        return cache[dtype]

    return get


@pytest.mark.parametrize("budget", ["whole", "chunked"])
@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_gets_exactly_the_tokens_that_fit(loaded, plain, dtype, draft, mode, budget):
    # "chunked": a budget below every prompt, so prefill takes steps that want no logits
    config = {"max_step_tokens": 16} if budget == "chunked" else {}
    eng = make_engine(loaded, dtype, draft, adaptive_k=mode == "auto", **config)
    spec_k = K if mode == "on" else None
    for distance in DISTANCES:
        prompt = prompt_for(distance)
        if distance == 0:
            with pytest.raises(ValidationError, match="do not fit"):
                eng.make_request("full", prompt, GREEDY)
            continue
        tokens, reason = run(eng, f"r{distance}", prompt, spec_k)
        assert (len(tokens), reason) == (distance, "length"), distance
        if dtype == "fp32":  # greedy output is the target's own (bf16 ties may flip)
            assert tokens == plain(dtype)[distance], distance
    if mode == "on" and draft is not None:
        assert eng.stats().drafted_tokens > 0  # it speculated


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_preempted_near_the_edge_is_recomputed_to_it(loaded, dtype, draft):
    """Two requests that cannot both reach the edge in a pool this small:
    the later one is preempted and recomputed near the context's end."""
    eng = make_engine(loaded, dtype, draft, num_blocks=16, adaptive_k=False)
    prompts = {"a": prompt_for(9)[:24], "b": prompt_for(10)[:24]}
    for request_id, prompt in prompts.items():
        # max_tokens past the edge: the pool is asked for the context's blocks alone
        request = eng.make_request(request_id, prompt, GREEDY)
        request.spec_k = K
        eng.submit(request)
    results: dict[str, tuple[list[int], str | None]] = {r: ([], None) for r in prompts}
    for _ in range(20 * MAX_CONTEXT):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.token_ids, out.finish_reason)
    assert eng.stats().preemptions > 0
    for request_id, prompt in prompts.items():
        tokens, reason = results[request_id]
        assert (len(tokens), reason) == (MAX_CONTEXT - len(prompt), "length"), request_id
    check_pool(eng)
