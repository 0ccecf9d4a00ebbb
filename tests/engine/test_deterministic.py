"""engine.deterministic: a request's tokens are the same bit for bit alone,
amid a batch of other requests, with speculation off or on (a draft model,
an EAGLE-3 head, the proposers that need no model, any k), across prefill
chunk sizes, after a prefix-cache hit and after preemption, in fp32, bf16
and q4, greedy and seeded sampled alike.

The reference is each request run alone, speculation off, its prompt in one
chunk. The tiny models' shapes are ones the native few-row kernels take
(a vocabulary that is a multiple of 16, inputs in groups of 32), so in bf16
and q4 every kernel the served dtypes use is exercised where the CPU has it.
Below, tests/layers/test_row_invariance.py checks the products and the
runner row by row."""

from __future__ import annotations

import random

import msgspec
import pytest

from specpage.config import load_config
from specpage.core.config_error import ConfigError
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from tests.support.checkpoints import models_by_dtype, tiny_checkpoint
from tests.support.head import tiny_head

VOCAB = 256
TAPS = [0, 1, 2]
K = 4
DTYPES = ("fp32", "bf16", "q4")
# With each token's log-probability, compared bit for bit too: a tiny model's
# greedy tokens rarely flip, its logits show any difference in summation.
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True,
                        logprobs=True)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("deterministic")
    hf = tiny_checkpoint(root / "target", num_hidden_layers=3, vocab_size=VOCAB,
                         hidden_size=128, intermediate_size=320, num_attention_heads=4,
                         num_key_value_heads=2)
    tiny_checkpoint(root / "draft", seed=1, num_hidden_layers=1, vocab_size=VOCAB,
                    hidden_size=64, intermediate_size=96)
    tiny_head(root / "head", hf.config, intermediate_size=96,
              eagle_aux_hidden_state_layer_ids=TAPS)
    return root


@pytest.fixture(scope="module")
def loaded(root):
    """Each dtype's models, loaded once: {dtype: (target, {draft: model})}."""
    return models_by_dtype(root)


def make_engine(loaded, dtype: str, draft: str | None = None, **config) -> Engine:
    target, drafts = loaded(dtype)
    options = dict(block_size=4, num_blocks=256, spec_k=K, max_context=160,
                   deterministic=True)
    options.update(config)
    return Engine(target, drafts[draft] if draft else None, None, EngineConfig(**options))


def prompt(seed: int, length: int = 70) -> list[int]:
    """Some repetition, so that the proposers that need no model find continuations."""
    rng = random.Random(seed)
    base = [rng.randrange(1, VOCAB) for _ in range(9)]
    return [t if rng.random() < 0.8 else rng.randrange(1, VOCAB) for t in base * 8][:length]


PROMPTS = {"a": prompt(1), "b": prompt(2, 45)}
OTHERS = {f"other{i}": prompt(100 + i, 20 + 13 * i) for i in range(5)}


Outputs = dict[str, list[tuple[int, float]]]


def run(eng: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
        spec_k: int | None = None) -> Outputs:
    """Every request submitted at once, run to its end: (token, its
    log-probability) by request id."""
    for request_id, (tokens, params) in requests.items():
        request = eng.make_request(request_id, tokens, params)
        request.spec_k = spec_k
        eng.submit(request)
    out: Outputs = {r: [] for r in requests}
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            out[o.request_id] += zip(o.token_ids, o.logprobs or [], strict=True)
    assert not eng.has_unfinished()
    eng.pool.check_integrity()
    return out


@pytest.fixture(scope="module")
def alone(loaded):
    """Each dtype's and kind's tokens alone, speculation off, prompts in one chunk."""
    cache: dict = {}

    def get(dtype: str, kind: str) -> Outputs:
        if (dtype, kind) not in cache:
            tokens = {}
            for request_id, p in PROMPTS.items():
                eng = make_engine(loaded, dtype, spec_k=0, spec_methods="")
                tokens[request_id] = run(eng, {request_id: (p, PARAMS[kind])})[request_id]
            cache[dtype, kind] = tokens
        return cache[dtype, kind]

    return get


def requests_of(kind: str, others: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    chosen = {r: (p, PARAMS[kind]) for r, p in PROMPTS.items()}
    if others:
        rng = random.Random(7)
        for request_id, p in OTHERS.items():  # greedy and sampled neighbours, other lengths
            chosen[request_id] = (p, msgspec.structs.replace(
                SEEDED, seed=rng.randrange(1 << 30), temperature=rng.choice([0.0, 0.7, 1.3]),
                max_tokens=rng.randrange(5, 40)))
    return chosen


def mine(out: Outputs) -> Outputs:
    return {r: out[r] for r in PROMPTS}


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_tokens_amid_a_batch_with_and_without_speculation(loaded, alone, dtype, kind):
    expected = alone(dtype, kind)
    for draft in ("draft", "head", None):
        for spec_k in (None, 0, 2, K):  # the policy's choice, off, forced to 2 and to K
            eng = make_engine(loaded, dtype, draft)
            out = run(eng, requests_of(kind, others=True), spec_k)
            assert mine(out) == expected, (draft, spec_k)
    assert eng.stats().drafted_tokens > 0  # the last engine speculated


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_tokens_across_prefill_chunk_sizes(loaded, alone, dtype, kind):
    expected = alone(dtype, kind)
    for budget in (K + 2, 7, 16, 33):  # prompts of 45 and 70 tokens in chunks
        eng = make_engine(loaded, dtype, "draft", max_step_tokens=budget)
        assert mine(run(eng, requests_of(kind, others=True))) == expected, budget


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_tokens_after_a_prefix_hit(loaded, alone, dtype, kind):
    expected = alone(dtype, kind)
    eng = make_engine(loaded, dtype, None)
    # A request whose prompt shares the first 60 tokens of "a" runs first and
    # leaves them cached; "a" then computes only its last 10 positions itself.
    warm = PROMPTS["a"][:60] + prompt(9, 17)
    run(eng, {"warm": (warm, GREEDY)})
    out = run(eng, requests_of(kind, others=True))
    assert eng.stats().prefix_cached_tokens >= 56
    assert mine(out) == expected


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_tokens_after_preemption(loaded, alone, dtype, kind):
    expected = alone(dtype, kind)
    # a pool too small for everything at once: sequences are preempted and recomputed
    eng = make_engine(loaded, dtype, "draft", num_blocks=48)
    out = run(eng, requests_of(kind, others=True), K)
    assert eng.stats().preemptions > 0
    assert mine(out) == expected


def test_the_setting_from_the_config_and_the_flag(tmp_path):
    path = tmp_path / "specpage.toml"
    path.write_text("[engine]\ndeterministic = true\n")
    assert load_config(path).engine.deterministic
    assert load_config(None, overrides={"engine.deterministic": "true"}).engine.deterministic
    assert not load_config(None).engine.deterministic
    with pytest.raises(ConfigError, match="deterministic takes tensor_parallel_size 1"):
        EngineConfig(deterministic=True, tensor_parallel_size=2)
