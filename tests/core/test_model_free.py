"""Proposers that need no model, in the torch-free core: the incremental
n-gram counts against a brute-force reference, the work they do per step,
the suffix cache's bound and its isolation by cache salt, and nothing left
of a sequence once it ends."""

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.engine_core import EngineCore
from specpage.core.model_free import (
    LEAST_SHARE,
    NO_SPECULATION,
    Candidate,
    Method,
    ModelFreeProposer,
    Speculation,
)
from specpage.core.ngram import COUNT_CAP, SHRINK, Evidence, NgramCounts, walk
from specpage.core.policy import SpecPolicy
from specpage.core.proposer_rules import NO_MODEL
from specpage.core.request import FinishReason, Request, SamplingParams, Sequence
from specpage.core.suffix_cache import SuffixCache
from tests.core.test_core_stateful import EOS, FakeExecutor

texts = st.lists(st.integers(0, 5), max_size=60)


def brute_force_next(tokens, context, n_min, n_max):
    """The likeliest follower of the longest n-gram ending context that
    occurs in tokens (ties: the latest to reach the highest count),
    rescanning everything."""
    for n in range(min(n_max, len(context)), n_min - 1, -1):
        gram = tuple(context[len(context) - n :])
        followers, best = Counter(), None
        for p in range(n, len(tokens)):
            if tuple(tokens[p - n : p]) == gram:
                followers[tokens[p]] += 1
                if best is None or followers[tokens[p]] >= followers[best]:
                    best = tokens[p]
        if followers:
            count, total = followers[best], sum(followers.values())
            return best, count / (total + SHRINK), Evidence(n, min(count, COUNT_CAP),
                                                             count == total)
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.lists(st.integers(1, 7), max_size=10), st.integers(1, 3), st.integers(0, 2))
def test_counts_added_piece_by_piece_equal_a_rescan(tokens, cuts, n_min, extra):
    n_max = n_min + extra
    counts, start = NgramCounts(n_min, n_max), 0
    for cut in cuts:  # the context grows as a sequence's does, a step at a time
        end = min(len(tokens), start + cut)
        counts.add(tokens[:end], start)
        start = end
    counts.add(tokens, start)
    whole = NgramCounts(n_min, n_max)
    whole.add(tokens, 0)
    assert counts.tables == whole.tables
    assert counts.num_entries == sum(1 if isinstance(f, int) else len(f.counts)
                                     for t in whole.tables for f in t.values())
    for end in range(len(tokens) + 1):
        context = tokens[:end]
        assert counts.next_token(context) == brute_force_next(tokens, context, n_min, n_max)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texts, max_size=6), st.integers(0, 5))
def test_removing_a_text_takes_out_exactly_its_counts(many, which):
    counts = NgramCounts(2, 4)
    for text in many:
        counts.add(text, 0)
    if many:
        gone = many.pop(which % len(many))
        counts.remove(gone)
    rest = NgramCounts(2, 4)
    for text in many:
        rest.add(text, 0)
    assert counts.tables == rest.tables and counts.num_entries == rest.num_entries


def test_work_per_step_does_not_grow_with_the_context():
    """Each new token costs one count per n-gram length, however long the
    context already is: counted operations, not time."""
    proposer = ModelFreeProposer(EngineConfig(spec_ngram_min=2, spec_ngram_max=4))
    for context in (10, 2000):
        seq = sequence(list(range(context)))
        proposer.propose(seq)  # the prompt, once
        before = proposer.num_counted
        for step in range(20):
            seq.token_ids.extend([step % 7, 1, 2])  # a step's accepted tokens
            proposer.propose(seq)
        assert proposer.num_counted - before == 20 * 3 * 3


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    proposer = ModelFreeProposer(EngineConfig(spec_methods="ngram", spec_model_free_k=4))
    seq = sequence([9, 1, 2, 3, 4, 5, 6, 8, 2, 3, 4, 7, 0, 3, 4])
    found = proposer.propose(seq)
    # "3 4" is followed by 5 and by 7; "0 3 4" never occurred, so the 3-gram
    # decides nothing and the counts tie: the latest, 7
    assert found is not None and found.method is Method.NGRAM
    assert found.tokens[0] == 7
    assert found.chance[0] == 1 / (2 + SHRINK)
    assert all(a >= b for a, b in zip(found.chance, found.chance[1:], strict=False))


def test_a_sequence_leaves_nothing_behind_but_its_text():
    proposer = ModelFreeProposer(EngineConfig())
    seqs = [sequence([1, 2, 3, 1, 2, 3, 1, 2], seq_id=i) for i in range(3)]
    for seq in seqs:
        proposer.propose(seq)
    assert len(proposer.contexts) == 3
    proposer.end(seqs[0], FinishReason.LENGTH)
    proposer.end(seqs[1], FinishReason.ABORT)
    proposer.end(seqs[2], FinishReason.ERROR)  # a failed request's text is not kept
    assert proposer.contexts == {}
    assert len(proposer.suffix.texts) == 2


def test_a_request_can_keep_its_text_out_of_the_suffix_cache():
    proposer = ModelFreeProposer(EngineConfig())
    seq = sequence([1, 2, 3, 1, 2, 3])
    seq.request.cache_text = False
    proposer.end(seq, FinishReason.STOP)
    assert proposer.suffix.num_tokens == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([b"", b"a", b"b"]), texts), max_size=30),
       st.integers(4, 80))
def test_the_suffix_cache_evicts_whole_texts_within_its_bound(adds, bound):
    cache = SuffixCache(bound, 2, 3)
    for salt, text in adds:
        cache.add(salt, text)
        cache.check_integrity()
        assert cache.num_tokens <= bound


def test_no_salt_is_proposed_another_salts_text():
    proposer = ModelFreeProposer(EngineConfig(spec_methods="suffix"))
    secret = [5, 6, 7, 8, 9, 10, 11, 12]
    writer = sequence([1, 2], salt=b"tenant-a", output=secret)
    proposer.end(writer, FinishReason.STOP)
    for salt in (b"tenant-b", b""):
        assert proposer.propose(sequence([5, 6, 7], salt=salt)) is None
    found = proposer.propose(sequence([5, 6, 7], salt=b"tenant-a"))
    assert found is not None and found.method is Method.SUFFIX and found.tokens[0] == 8


def test_a_seeded_sample_is_proposed_from_its_own_context_only():
    """Its tokens depend on its proposals, which must not depend on other requests."""
    proposer = ModelFreeProposer(EngineConfig())
    proposer.end(sequence([1, 2], output=[5, 6, 7, 8, 9]), FinishReason.STOP)
    seeded = sequence([5, 6, 7], params=SamplingParams(temperature=1.0, seed=3))
    assert proposer.propose(seeded) is None
    greedy = sequence([5, 6, 7], params=SamplingParams(temperature=0.0, seed=3))
    assert proposer.propose(greedy) is not None


def test_chances_follow_what_verification_accepted_of_tokens_on_the_same_evidence():
    proposer = ModelFreeProposer(EngineConfig(spec_methods="ngram", spec_model_free_k=4,
                                              spec_ngram_min=2, spec_ngram_max=4))
    text = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # "1 2 3" was followed by 4, 5, 6, 7
    greedy = sequence(text)
    before = proposer.propose(greedy)
    assert before is not None and before.tokens == [4, 5, 6, 7]
    # the first after a 3-gram, the others after 4-grams, each seen once
    assert before.evidence == [Evidence(3, 1, True)] + [Evidence(4, 1, True)] * 3
    assert before.chance == pytest.approx([(1 / (1 + SHRINK)) ** n for n in range(1, 5)])
    for _ in range(50):  # verification accepts two, rejects the third, never tests the fourth
        speculation = Speculation(4, tuple(before.tokens), Method.NGRAM, 0.0,
                                  tuple(before.evidence))
        proposer.observe(greedy, speculation, accepted=2)
    table, prior = proposer.chances, 1 / (1 + SHRINK)
    after_3gram = table.chance((Method.NGRAM, False, Evidence(3, 1, True)), prior)
    after_4gram = table.chance((Method.NGRAM, False, Evidence(4, 1, True)), prior)
    assert after_3gram > 0.9  # tested 50 times, accepted 50
    assert abs(after_4gram - 0.5) < 0.05  # tested 100 times, accepted 50
    assert table.chance((Method.SUFFIX, False, Evidence(3, 1, True)), 0.25) == 0.25  # untested
    # nor is a sampled request's chance what greedy requests accepted
    assert table.chance((Method.NGRAM, True, Evidence(3, 1, True)), 0.25) == 0.25
    after = proposer.propose(sequence(text, seq_id=1))
    assert after is not None and after.chance[0] == after_3gram
    assert after.chance[1] == pytest.approx(after_3gram * after_4gram)
    # a seeded sample's chances are its confidences alone, whatever others taught the table
    seeded = proposer.propose(sequence(text, seq_id=2,
                                       params=SamplingParams(temperature=1.0, seed=3)))
    assert seeded is not None and seeded.chance == before.chance


def test_the_suffix_cache_keeps_a_finished_output_after_the_end_of_its_prompt():
    proposer = ModelFreeProposer(EngineConfig(spec_ngram_min=2, spec_ngram_max=3))
    prompt, output = [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33]
    proposer.end(sequence(prompt, output=output), FinishReason.STOP)
    assert list(proposer.suffix.texts.values()) == [(24, 25, 26, 30, 31, 32, 33)]
    found = proposer.propose(sequence([9, 25, 26], seq_id=1))  # after the prompt's end: 30
    assert found is not None and found.method is Method.SUFFIX and found.tokens[:2] == [30, 31]


def sequence(tokens, seq_id=0, salt=b"", params=None, output=()):
    """A sequence of prompt `tokens` that has produced `output` so far."""
    params = params or SamplingParams(max_tokens=64, temperature=0.0)
    request = Request(f"r{seq_id}", tuple(tokens), params, cache_salt=salt)
    seq = Sequence(seq_id, request, 0, list(tokens) + list(output))
    request.sequences.append(seq)
    return seq


def test_a_prompt_is_counted_in_by_the_steps_that_compute_it():
    """Prompt lookup's counts follow the committed tokens: a prompt
    prefilled in chunks is counted in chunk by chunk by the steps that
    compute it, so a decoding step counts only the tokens it adds, however
    long the prompt (counted operations, not time); nothing stays once the
    request ends."""
    config = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_step_tokens=8,
                          spec_ngram_min=2, spec_ngram_max=4, spec_model_free_k=4)
    policy = SpecPolicy(0, NO_MODEL, adaptive=False, model_free_k=4)
    core = EngineCore(config, BlockPool(64, 4), policy, 64, eos_token_ids=(EOS,))
    core.scheduler.speculate = lambda seq, batch: NO_SPECULATION  # sampled tokens only
    executor = FakeExecutor(random.Random(0))
    prompt = [(7 * i) % 13 + 1 for i in range(20)]
    core.submit(Request("r", tuple(prompt), SamplingParams(max_tokens=6, temperature=0.0)))
    proposer, seq = core.model_free, core.scheduler.waiting[0][1]
    for computed in (8, 16):  # chunks of max_step_tokens
        core.apply(executor.execute(core.schedule()))
        assert proposer.contexts[seq.seq_id][1] == seq.num_computed == computed
    whole = NgramCounts(2, 4)
    whole.add(prompt, 0)
    core.apply(executor.execute(core.schedule()))  # the prompt's last 4, and a token
    counts, indexed = proposer.contexts[seq.seq_id]
    assert indexed == seq.num_computed == 20 and counts.tables == whole.tables
    before = proposer.num_counted
    core.apply(executor.execute(core.schedule()))  # a decoding step: one token in
    assert proposer.num_counted - before == 3  # one count per n-gram length
    while core.has_unfinished():
        core.apply(executor.execute(core.schedule()))
    assert proposer.contexts == {}


chances = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8).map(
    lambda steps: list(_chain(steps)))


def _chain(steps):
    """Per token the chance that it and every one before it are accepted."""
    chain = 1.0
    for p in steps:
        chain *= p
        yield chain


def priced(costs: list[float], scale: float) -> tuple[SpecPolicy, Sequence]:
    """A model-free policy on this cost curve, and a sequence whose own
    record scales its chances by `scale` (shrunk)."""
    policy = SpecPolicy(0, NO_MODEL, model_free_k=8)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    policy.calibrate(list(zip(sizes, sorted(costs) + [costs[-1]] * 10, strict=False)), [])
    seq = sequence([1, 2, 3])
    seq.model_free_accepted, seq.model_free_expected = 10.0 * scale, 10.0
    return policy, seq


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.floats(0.001, 0.05), min_size=3, max_size=6),
       batch=st.integers(1, 64), found=chances, scale=st.floats(0.25, 2.0))
def test_below_the_floor_no_model_free_proposal_pays_and_just_above_one_can(
        costs, batch, found, scale):
    """The policy's floor bounds the first token's chance: a candidate whose
    first token (scaled by the sequence's own record) falls below it gets no
    proposals at this batch whatever follows it, so the proposer may stop
    looking there; one just above it, with every later token sure, gets
    some. For any measured cost curve."""
    policy, seq = priced(costs, scale)
    length, floor, _ = policy.model_free_lookup(seq, batch)
    evidence = [Evidence(2, 1, True)] * 8
    below = [c * min(1.0, floor * 0.999 / found[0]) if found[0] > 0 else 0.0 for c in found]
    if floor > 0 and below[0] < floor:
        candidate = Candidate(Method.NGRAM, list(range(len(below))), below, evidence[:len(below)])
        assert policy.speculate(seq, batch, candidate) == NO_SPECULATION
    if 0 < floor < 0.999 and length:
        sure = [floor * 1.001] * length
        candidate = Candidate(Method.NGRAM, list(range(length)), sure, evidence[:length])
        assert policy.speculate(seq, batch, candidate).k > 0


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.floats(0.001, 0.05), min_size=3, max_size=6),
       batch=st.integers(1, 64), found=chances, scale=st.floats(0.25, 2.0))
def test_no_proposal_takes_a_token_the_share_rule_turns_down(costs, batch, found, scale):
    """A token after the first whose chance (scaled as the policy scales
    it) is below LEAST_SHARE of the tokens those before it promise is never
    proposed, nor any after it: a candidate cut just before it (where a
    proposer's walk ends, given a floor) gets the same proposal."""
    policy, seq = priced(costs, scale)
    _, _, own = policy.model_free_lookup(seq, batch)
    evidence = [Evidence(2, 1, True)] * len(found)
    scaled = [min(1.0, c * own) for c in found]
    tokens, cut = 1.0 + scaled[0], len(found)
    for j in range(1, len(found)):
        if scaled[j] < LEAST_SHARE * tokens:
            cut = j
            break
        tokens += scaled[j]
    whole = Candidate(Method.NGRAM, list(range(len(found))), found, evidence)
    proposal = policy.speculate(seq, batch, whole)
    assert proposal.k <= cut
    short = Candidate(Method.NGRAM, whole.tokens[:cut], found[:cut], evidence[:cut])
    assert policy.speculate(seq, batch, short) == proposal


def test_a_floor_past_a_hundred_tokens_of_proposals():
    """Proposals of up to 120 tokens a step: no run of one chance passes the
    share rule past 100 tokens, and the floor is still found."""
    policy = SpecPolicy(0, NO_MODEL, model_free_k=120)
    policy.calibrate([(n, 0.01 + 0.0001 * n) for n in (1, 2, 4, 8, 16, 64, 128, 256)], [])
    length, floor, _ = policy.model_free_lookup(sequence([1, 2, 3]), 1)
    assert 0 < length <= 100 and 0 < floor < 1


def test_a_walk_with_a_floor_ends_where_the_share_rule_turns_a_token_down():
    """Given a floor, the proposer's walk ends at the first later token whose
    chance, times the sequence's scale, is below LEAST_SHARE of what the
    tokens before it promise: with a scale that makes every later chance
    tiny, after one token; with scale 1, or no floor, the whole
    continuation."""
    text = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    proposer = ModelFreeProposer(EngineConfig(spec_methods="ngram", spec_model_free_k=4))
    seq = sequence(text)
    whole = proposer.propose(seq, 4)
    assert whole is not None and len(whole.tokens) == 4
    assert proposer.propose(seq, 4, floor=1e-9) == whole
    found = proposer.propose(seq, 4, floor=1e-9, scale=1e-4)
    assert found is not None and found.tokens == whole.tokens[:1]
    assert found.chance == whole.chance[:1]


def test_the_floor_stops_each_walk_at_its_first_token():
    """A continuation whose first token is turned down is none, found with
    one lookup (counted, not timed); a floor no token falls below changes
    nothing."""
    counts = NgramCounts(1, 4)
    text = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    counts.add(text, 0)
    asked = []

    def next_token(context):
        asked.append(1)
        return counts.next_token(context)

    whole = walk(next_token, 4, text, 4)
    assert len(whole.tokens) == 4 and len(asked) == 4 and whole == counts.continuation(text, 4)
    asked.clear()
    assert walk(next_token, 4, text, 4, lambda confidence, evidence: False).tokens == []
    assert len(asked) == 1
    assert counts.continuation(text, 4, lambda confidence, evidence: True) == whole
    proposer = ModelFreeProposer(EngineConfig(spec_methods="ngram", spec_model_free_k=4))
    seq = sequence(text)
    found = proposer.propose(seq, 4)
    assert found is not None and proposer.propose(seq, 4, floor=found.chance[0] / 2) == found
    assert proposer.propose(seq, 4, floor=found.chance[0] * 1.01) is None
