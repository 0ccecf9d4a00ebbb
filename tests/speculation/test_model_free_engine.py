"""Proposals that need no model, through the engine on tiny random
checkpoints (fp32): greedy output equals speculation off, token for token,
with prompt lookup, the suffix cache, the corpus table and the draft model
proposing for different sequences in the same steps; with n > 1, prefix-cache hits,
preemption, aborts, stop tokens and max_tokens reached inside an accepted
run. Which method proposes for a sequence is fixed by the test (the
policy's choice is not what these tests are about); the policy's own
choice is checked for exactness too."""

from collections import Counter

import pytest

from specpage.core.corpus import CorpusTable
from specpage.core.model_free import Method, ModelFreeProposer, Speculation
from specpage.core.request import SamplingParams
from specpage.models.loader import load_model
from tests.engine.test_engine import drain, engine, hf_greedy, prompts
from tests.support.checkpoints import target_and_draft, tiny_checkpoint
from tests.support.head import tiny_head

ROUTES = {"draft": None, "ngram": Method.NGRAM, "suffix": Method.SUFFIX, "corpus": Method.CORPUS}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_draft(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def head_models(tmp_path_factory):
    """A 3-layer target and an EAGLE-3 head proposing among its favourite tokens."""
    root = tmp_path_factory.mktemp("head")
    hf = tiny_checkpoint(root / "target", num_hidden_layers=3)
    counts = Counter(t for p in repetitive(6) for t in hf_greedy(hf, p, 16))
    tiny_head(root / "head", hf.config, seed=2, draft_vocab=[t for t, _ in counts.most_common(4)],
              eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    return hf, load_model(root / "target"), load_model(root / "head")


def corpus_of(hf):
    """A corpus table of a tiny target's own greedy answers (to the
    workload's prompts: a random model's habits are its alone)."""
    return CorpusTable.count([(p[-3:] + hf_greedy(hf, p, 24), 3) for p in repetitive(6)], "tiny")


@pytest.fixture(scope="module")
def corpus(models):
    return corpus_of(models[0])


def with_corpus(eng, corpus):
    """eng's proposers with `corpus` as the corpus method's table (an
    engine finds one by its tokenizer; these checkpoints have none)."""
    eng.core.model_free = ModelFreeProposer(eng.config, corpus=corpus)
    return eng


def routed(eng):
    """Each request's sequences propose by the method its id starts with."""
    core = eng.core

    def speculate(seq, batch):
        method = ROUTES[seq.request.request_id.split("-")[0]]
        if method is None:
            return Speculation(eng.config.spec_k)
        found = core.model_free.propose(seq, methods=frozenset({method}))
        if found is None:
            return Speculation(0)
        return Speculation(len(found.tokens), tuple(found.tokens), found.method,
                           sum(found.chance))

    core.scheduler.speculate = speculate
    return eng


def repetitive(count, seed=0):
    """Prompts that repeat themselves, so that lookups find matches."""
    return [p + p[: len(p) // 2] + p for p in prompts(count, seed)]


def workload(params_of):
    """Requests of every route arriving over a few steps, some prompts twice
    (prefix-cache hits, and the suffix cache holds the first's text)."""
    batch = repetitive(6)
    arrivals = {}
    for i, prompt in enumerate(batch + batch[:3]):
        route = list(ROUTES)[i % len(ROUTES)]
        arrivals.setdefault((0, 3, 9, 5)[i % len(ROUTES)] + 60 * (i >= 6), []).append(
            (f"{route}-{i}", prompt, params_of(i)))
    return arrivals


def greedy(i):
    return SamplingParams(max_tokens=(19, 7, 24, 5, 30)[i % 5], temperature=0.0,
                          ignore_eos=True, n=2 if i % 5 in (1, 3) else 1)


@pytest.mark.parametrize("config", [
    dict(),
    dict(num_blocks=40, max_step_tokens=24),  # preemption and chunked prefill
], ids=["roomy", "preempting"])
@pytest.mark.parametrize("draft", ["model", "head"])
def test_mixed_proposers_keep_greedy_output_exact(models, head_models, corpus, draft, config):
    pair = models if draft == "model" else head_models
    off = drain(engine(pair, spec_k=0, **config), workload(greedy))
    table = corpus if draft == "model" else corpus_of(pair[0])
    eng = routed(with_corpus(engine(pair, spec_methods="ngram,suffix,corpus", **config), table))
    on = drain(eng, workload(greedy))
    assert on == off
    by_method = eng.stats().by_method
    for method in ("draft", "ngram", "suffix", "corpus"):
        assert by_method[method].drafted > 0, method
        # a random head is rarely right: it must propose, not be accepted
        assert by_method[method].accepted > 0 or (method, draft) == ("draft", "head"), method
    if config:
        assert eng.stats().preemptions > 0


def test_stop_tokens_and_aborts_with_model_free_proposals(models, corpus):
    batch = repetitive(6, seed=3)
    stop = batch[0][-1]  # a token the lookups will propose

    def params(i):
        return SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,),
                              ignore_eos=True)

    arrivals = {0: [(f"{list(ROUTES)[i % len(ROUTES)]}-{i}", p, params(i))
                    for i, p in enumerate(batch)]}
    aborts = {4: ["ngram-1", "corpus-3"]}
    off = drain(engine(models, spec_k=0), arrivals, aborts)
    on = drain(routed(with_corpus(engine(models, spec_methods="ngram,suffix,corpus"), corpus)),
               arrivals, aborts)
    assert on == off
    assert {reason for _, reason in on.values()} >= {"abort"}


def test_the_policys_own_choice_keeps_greedy_output_exact(models, corpus):
    off = drain(engine(models, spec_k=0), workload(greedy))
    for draft in ("draft", None):
        eng = with_corpus(engine(models, draft, spec_methods="ngram,suffix,corpus",
                                 adaptive_k=True), corpus)
        assert drain(eng, workload(greedy)) == off
        assert eng.core.model_free.contexts == {}  # nothing left of finished sequences


def test_seeded_samples_with_model_free_proposals_ignore_the_batch(models, corpus):
    """A seeded sample's proposals come from its own context (and the
    corpus table, no request's text) and its proposal lengths from their
    confidences alone, so its tokens are the same alone and amid other
    requests."""
    def seeded(i):
        return SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True)

    batch = repetitive(4, seed=5)
    def adaptive():
        return with_corpus(engine(models, None, adaptive_k=True,
                                  spec_methods="ngram,suffix,corpus"), corpus)

    together = drain(adaptive(), {0: [(f"ngram-{i}", p, seeded(i)) for i, p in enumerate(batch)]})
    for i, prompt in enumerate(batch):
        alone = drain(adaptive(), {0: [(f"ngram-{i}", prompt, seeded(i))]})
        assert alone[(f"ngram-{i}", 0)] == together[(f"ngram-{i}", 0)]
