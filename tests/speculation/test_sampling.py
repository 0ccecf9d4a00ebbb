"""Speculative sampling keeps the target's distribution.

On an 8-token vocabulary the exact joint distribution of sampled tokens is
computable from the target's logits. Thousands of seeded requests sample
with and without a (deliberately different) draft; both empirical
distributions must fit the exact target one by a chi-square test at
significance 0.001, while the draft's own distribution must be rejected, so
the test can tell them apart.
"""

import itertools
import json
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from specpage.speculation.sampler import probabilities
from specpage.speculation.sampling_rows import greedy_tokens

VOCAB = 8
PROMPT = [1, 2, 3]
RUNS = 4000
ALPHA = 1e-3


def peaked_model(folder, seed, hidden_size=32, peak=40.0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)  # peaked, distinct distributions
    model.save_pretrained(folder)
    return model


def exact_joint(model, params, prompt=PROMPT):
    """P(x2, x3) of the 2nd and 3rd sampled tokens, over the 1st."""
    def dist(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1:]
        return probabilities(logits, torch.tensor([params.temperature]),
                             torch.tensor([params.top_k]), torch.tensor([params.top_p]))[0]
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = dist(())
    for x1 in range(VOCAB):
        p2 = dist((x1,))
        for x2 in range(VOCAB):
            joint[x2] += p1[x1] * p2[x2] * dist((x1, x2)).double()
    return joint.flatten()


def sampled_joint(target, draft, params, proposed=None, prompt=PROMPT, methods="",
                  deterministic=False, outputs=None):
    """Counts of (x2, x3) over RUNS seeded requests; `proposed` collects
    every token the draft proposed; methods: the model-free proposers on;
    outputs, a dict: each request's tokens, by seed."""
    engine = Engine(target, draft, None, EngineConfig(
        block_size=4, num_blocks=2048, max_num_seqs=256, max_step_tokens=2048,
        spec_k=2 if draft is not None or methods else 0, adaptive_k=False, spec_methods=methods,
        deterministic=deterministic))
    if proposed is not None:
        propose = engine.executor.proposer.propose
        engine.executor.proposer.propose = (
            lambda scheduled, guides: record(propose(scheduled, guides), proposed))
    for seed in range(RUNS):
        engine.add_request(str(seed), prompt, SamplingParams(
            max_tokens=4, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=seed, ignore_eos=True))
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    counts = Counter(tokens[1] * VOCAB + tokens[2] for tokens in outputs.values())
    return torch.tensor([counts[i] for i in range(VOCAB * VOCAB)], dtype=torch.float64), engine


def record(proposal, proposed):
    proposed.extend(token for tokens in proposal.tokens for token in tokens)
    return proposal


def chi_square_p(observed, expected_probs):
    expected = expected_probs / expected_probs.sum() * observed.sum()
    big = expected >= 5  # pool the sparse cells so the test is valid
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1] * (obs[:-1].sum() / exp[:-1].sum())
    return chisquare(obs.numpy(), exp.numpy()).pvalue


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top-k-top-p"])
def test_model_free_proposals_preserve_the_target_distribution(tmp_path, params):
    """Prompt lookup proposes with no distribution (q one-hot): accepted with
    probability p(x), else the next token is drawn from p without x."""
    # after any first token v, the context's own n-grams propose 2, v + 1, 2, ...
    prompt = [t for v in range(VOCAB) for t in (2, v)] + [2]
    target_hf = peaked_model(tmp_path / "t", seed=0)
    target = load_model(tmp_path / "t")
    exact = exact_joint(target_hf, params, prompt)

    speculative, engine = sampled_joint(target, None, params, prompt=prompt, methods="ngram")
    counts = engine.stats().by_method["ngram"]
    assert counts.drafted > RUNS and counts.accepted < counts.drafted
    if params.top_k == 0:  # top-k and top-p may leave the proposed token no mass
        assert counts.accepted > 0
    assert chi_square_p(speculative, exact) > ALPHA


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top-k-top-p"])
def test_speculative_sampling_preserves_the_target_distribution(tmp_path, params):
    target_hf = peaked_model(tmp_path / "t", seed=0)
    draft_hf = peaked_model(tmp_path / "d", seed=1)
    target, draft = load_model(tmp_path / "t"), load_model(tmp_path / "d")
    exact = exact_joint(target_hf, params)
    draft_exact = exact_joint(draft_hf, params)
    assert 0.5 * (exact - draft_exact).abs().sum() > 0.2  # the draft really differs

    speculative, engine = sampled_joint(target, draft, params)
    plain, _ = sampled_joint(target, None, params)
    stats = engine.stats()
    assert stats.drafted_tokens > RUNS and 0 < stats.accepted_tokens < stats.drafted_tokens

    assert chi_square_p(speculative, exact) > ALPHA
    assert chi_square_p(plain, exact) > ALPHA
    assert chi_square_p(speculative, draft_exact) < ALPHA  # the test has power


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top-k-top-p"])
def test_coupled_acceptance_keeps_the_distribution_and_each_seed_its_tokens(tmp_path, params):
    """engine.deterministic: a proposal is accepted while it equals the token
    the seeded draw takes from the target's distribution at its position, so
    each seed's tokens are those of sampling without speculation, and their
    distribution is the target's; with a draft model and with prompt lookup.
    (head_dim 32: the native attention kernel takes it.)"""
    target_hf = peaked_model(tmp_path / "t", seed=0, hidden_size=64, peak=10.0)
    peaked_model(tmp_path / "d", seed=1, hidden_size=64, peak=10.0)
    target, draft = load_model(tmp_path / "t"), load_model(tmp_path / "d")
    # prompt lookup: after any first token v, the context's n-grams propose 2, v + 1, 2, ...
    lookup = [t for v in range(VOCAB) for t in (2, v)] + [2]
    for proposer, methods, prompt in ((draft, "", PROMPT), (None, "ngram", lookup)):
        exact = exact_joint(target_hf, params, prompt)
        assert (exact > 0).sum() > 1  # the chi-square test has cells to tell
        plain: dict = {}
        counts, _ = sampled_joint(target, None, params, prompt=prompt, deterministic=True,
                                  outputs=plain)
        assert chi_square_p(counts, exact) > ALPHA
        speculative: dict = {}
        counts, engine = sampled_joint(target, proposer, params, prompt=prompt, methods=methods,
                                       deterministic=True, outputs=speculative)
        stats = engine.stats()
        assert stats.drafted_tokens > RUNS and 0 < stats.accepted_tokens < stats.drafted_tokens
        assert speculative == plain
        assert chi_square_p(counts, exact) > ALPHA


def test_seeded_draws_are_uniform_and_independent():
    from specpage.speculation.sampler import Purpose, uniform

    draws = torch.tensor([uniform(s, p, Purpose.ACCEPT)
                          for s, p in itertools.product(range(100), range(100))])
    assert abs(float(draws.mean()) - 0.5) < 0.01
    counts = torch.histc(draws, bins=20, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > ALPHA
    assert uniform(1, 2, Purpose.ACCEPT) != uniform(1, 2, Purpose.RESIDUAL)


def test_a_draft_restricted_to_part_of_the_vocabulary_keeps_the_distribution(tmp_path):
    """draft_vocab.json limits what the draft proposes (logit -inf, probability
    0 elsewhere); the tokens it can never propose still come out of the
    target at their exact rates, through the residual distribution."""
    params = SamplingParams(temperature=1.0)
    target_hf = peaked_model(tmp_path / "t", seed=0)
    peaked_model(tmp_path / "d", seed=1)
    allowed = [0, 2, 3, 5]
    (tmp_path / "d" / "draft_vocab.json").write_text(json.dumps({"token_ids": allowed}))
    target, draft = load_model(tmp_path / "t"), load_model(tmp_path / "d")
    exact = exact_joint(target_hf, params)
    proposed = []
    speculative, engine = sampled_joint(target, draft, params, proposed)
    stats = engine.stats()
    assert stats.drafted_tokens > RUNS and 0 < stats.accepted_tokens < stats.drafted_tokens
    assert set(proposed) <= set(allowed)
    assert chi_square_p(speculative, exact) > ALPHA
    # tokens outside the draft's vocabulary are sampled all the same
    outside = [x2 * VOCAB + x3 for x2 in range(VOCAB) for x3 in range(VOCAB)
               if x2 not in allowed or x3 not in allowed]
    assert speculative[outside].sum() > 0.1 * RUNS


def test_one_hot_acceptance_is_accept_with_one_hot_proposals():
    """The verifier's path for proposals with no distribution takes the same
    tokens, bit for bit, as accept() given those proposals as one-hot q over
    padded rows: sequences with and without proposals, rejections at every
    position, and a proposed token of probability 1 (no residual mass)."""
    from specpage.core.step import Sampling, SeqWork
    from specpage.speculation.acceptance import accept
    from specpage.speculation.proposal import Proposal
    from specpage.speculation.sampler import Purpose, uniform
    from specpage.speculation.verifier import _one_hot

    vocab = 7
    generator = torch.Generator().manual_seed(3)
    for case in range(300):
        ks = [int(k) for k in torch.randint(0, 5, (int(torch.randint(1, 5, ())),),
                                            generator=generator)]
        works = [SeqWork(r, 10 * case, [1], [0], True, k, 0, [],
                         Sampling(0.8, 0, 1.0, case * 31 + r, False))
                 for r, k in enumerate(ks)]
        # peaked rows, so that proposals of the likeliest token are often accepted
        logits = torch.randn(sum(k + 1 for k in ks), vocab, generator=generator) * 3
        target = torch.softmax(logits, -1)
        if case % 10 == 0:  # a row certain of one token
            target[0] = torch.nn.functional.one_hot(torch.tensor(2), vocab).float()
        tokens, start = [], 0
        for k in ks:
            likeliest = target[start : start + k].argmax(-1)
            other = torch.randint(0, vocab, (k,), generator=generator)
            pick = torch.rand(k, generator=generator) < 0.7
            tokens.append(torch.where(pick, likeliest, other).tolist())
            start += k + 1
        proposal = Proposal(tokens, [None] * len(ks), [])
        decided = _one_hot(list(range(len(ks))), works, ks, proposal, target)

        k_max = max(ks)
        target_padded = torch.zeros(len(ks), k_max + 1, vocab)
        draft_padded = torch.zeros(len(ks), k_max, vocab)
        draft_tokens = torch.zeros(len(ks), k_max, dtype=torch.int64)
        start = 0
        for r, k in enumerate(ks):
            target_padded[r, : k + 1] = target[start : start + k + 1]
            start += k + 1
            for j, t in enumerate(tokens[r]):
                draft_tokens[r, j] = t
                draft_padded[r, j, t] = 1.0
        u_accept = torch.tensor([[uniform(w.sampling.seed, w.end + j, Purpose.ACCEPT)
                                  for j in range(k_max)] for w in works],
                                dtype=torch.float64).view(len(ks), k_max)
        u_next = torch.tensor([[uniform(w.sampling.seed, w.end + a,
                                        Purpose.RESIDUAL if a < k else Purpose.SAMPLE)
                                for a in range(k_max + 1)] for w, k in zip(works, ks, strict=True)],
                              dtype=torch.float64)
        expected = accept(draft_tokens, draft_padded, target_padded, torch.tensor(ks),
                          u_accept, u_next)
        assert decided == list(zip(expected.num_accepted, expected.next_token, strict=True)), case


def _native():
    from specpage.kernels.cpu.native import native_kernels

    kernels = native_kernels()
    if kernels is None:
        pytest.skip("native kernels not built")
    return kernels


def _cdf(logits: torch.Tensor, temperature: float, removed: int = -1) -> torch.Tensor:
    """float64 cumulative distribution of softmax(logits / T), removed taken out."""
    p = torch.softmax(logits.double() / temperature, -1)
    if removed >= 0:
        p[removed] = 0
    return p.cumsum(-1) / p.sum()


def test_native_temperature_draws_are_the_inverse_cdf():
    """kernels/cpu/sampling.cpp draws, per row, the first token whose
    cumulative probability exceeds u (to float32 rounding), from the row
    alone whatever else the call holds, with a removed token never drawn
    while anything else has weight, and grammar-forbidden (-inf) tokens never."""
    kernels = _native()
    generator = torch.Generator().manual_seed(11)
    for case in range(60):
        vocab = int(torch.randint(2, 3000, (), generator=generator))
        rows = 5
        logits = torch.randn(rows, vocab, generator=generator) * 4
        logits[1, ::3] = float("-inf")
        temperature = (torch.rand(rows, generator=generator) * 1.5 + 0.2).tolist()
        removed = [-1, -1, int(logits[2].argmax()), int(torch.randint(0, vocab, ())), -1]
        for _ in range(10):
            u = torch.rand(rows, generator=generator, dtype=torch.float64)
            drawn = kernels.temperature_draws(
                logits, torch.arange(rows), 1 / torch.tensor(temperature), u,
                torch.tensor(removed)).tolist()
            alone = kernels.temperature_draws(
                logits, torch.tensor([3]), 1 / torch.tensor(temperature[3:4]), u[3:4],
                torch.tensor(removed[3:4])).tolist()
            assert drawn[3] == alone[0]
            for r, t in enumerate(drawn):
                cdf = _cdf(logits[r], temperature[r], removed[r])
                below = float(cdf[t - 1]) if t else 0.0
                assert below - 1e-5 <= float(u[r]) <= float(cdf[t]) + 1e-5, (case, r)
                assert t != removed[r] and logits[r, t] > float("-inf")


def test_native_temperature_probabilities_and_a_certain_token():
    kernels = _native()
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 49152, generator=generator) * 5
    tokens = torch.tensor([0, int(logits[1].argmax()), 77, 49151])
    inverse = torch.tensor([1 / 0.7, 1.0, 2.0, 1 / 1.3])
    ours = kernels.temperature_probabilities(logits, torch.arange(4), tokens, inverse)
    reference = torch.softmax(logits.double() * inverse[:, None].double(), -1)[
        torch.arange(4), tokens]
    assert torch.allclose(ours.double(), reference, rtol=1e-5, atol=0)
    # one token of any weight: removing it leaves nothing else, so it is drawn
    certain = torch.full((1, 50), float("-inf"))
    certain[0, 7] = 1.0
    for u in (0.0, 0.5, 0.999):
        drawn = kernels.temperature_draws(certain, torch.tensor([0]), torch.tensor([1.0]),
                                          torch.tensor([u], dtype=torch.float64),
                                          torch.tensor([7]))
        assert drawn.tolist() == [7]
    with pytest.raises(RuntimeError, match="row 4 is outside the logits' 4 rows"):
        kernels.temperature_probabilities(logits, torch.tensor([4]), tokens[:1], inverse[:1])


def _two_calls(kernels, works, ks, offsets, tokens, logits):
    """one_hot_acceptance's reference: every proposal's probability
    (temperature_probabilities), the verifier's _decide on them with
    sampler.uniform, then the draw (temperature_draws)."""
    from specpage.speculation.proposal import Proposal
    from specpage.speculation.verifier import _decide

    inverse = [1.0 / w.sampling.temperature for w in works]
    at_rows = [offsets[r] + j for r, k in enumerate(ks) for j in range(k)]
    at_inverse = [inverse[r] for r, k in enumerate(ks) for _ in range(k)]
    flat = [t for r, k in enumerate(ks) for t in tokens[r][:k]]
    p_at = kernels.temperature_probabilities(
        logits, torch.tensor(at_rows, dtype=torch.int64), torch.tensor(flat, dtype=torch.int64),
        torch.tensor(at_inverse, dtype=torch.float32)).tolist() if at_rows else []
    proposal = Proposal(tokens, [None] * len(ks), [])
    decided = _decide(list(range(len(ks))), works, ks, proposal, p_at)
    drawn = kernels.temperature_draws(
        logits, torch.tensor([offsets[r] + a for r, a in enumerate(decided.accepted)]),
        torch.tensor(inverse, dtype=torch.float32),
        torch.tensor(decided.draws, dtype=torch.float64),
        torch.tensor(decided.removed, dtype=torch.int64)).tolist()
    return list(zip(decided.accepted, drawn, strict=True))


def test_native_one_hot_acceptance_is_the_two_calls_and_decide():
    """kernels/cpu/sampling.cpp's one_hot_acceptance takes, bit for bit, the
    tokens that the proposals' probabilities, the verifier's _decide (with
    sampler.uniform's seeded draws) and temperature_draws take: sequences
    with and without proposals, rejections at every position, rows certain
    of a token, forbidden (-inf) tokens, and seeds negative or past 2^63."""
    from specpage.core.step import Sampling, SeqWork
    from specpage.speculation.proposal import Proposal
    from specpage.speculation.verifier import _one_hot_native

    kernels = _native()
    generator = torch.Generator().manual_seed(21)
    seeds = [0, 1, -1, -(1 << 70) + 5, (1 << 63) + 12345, (1 << 64) - 1, 1 << 80, 987654321]
    for case in range(200):
        vocab = int(torch.randint(2, 700, (), generator=generator))
        ks = [int(k) for k in torch.randint(0, 6, (int(torch.randint(1, 5, ())),),
                                            generator=generator)]
        works = [SeqWork(r, 7 * case + r, [1], [0], True, k, 0, [],
                         Sampling(float(torch.rand((), generator=generator)) * 1.5 + 0.2, 0,
                                  1.0, seeds[(case + r) % len(seeds)], False))
                 for r, k in enumerate(ks)]
        gap = int(torch.randint(0, 3, (), generator=generator))  # rows that are not sampled
        offsets, row = [], gap
        for k in ks:
            offsets.append(row)
            row += k + 1 + gap
        logits = torch.randn(row, vocab, generator=generator) * 4
        if case % 7 == 0:
            logits[:, ::2] = float("-inf")
        tokens = []
        for r, k in enumerate(ks):
            rows = logits[offsets[r] : offsets[r] + k]
            likeliest = rows.argmax(-1)
            other = torch.randint(0, vocab, (k,), generator=generator)
            pick = torch.rand(k, generator=generator) < 0.7
            tokens.append(torch.where(pick, likeliest, other).tolist())
        if case % 10 == 0 and ks[0]:  # a row certain of its proposed token
            logits[offsets[0]] = float("-inf")
            logits[offsets[0], tokens[0][0]] = 1.0
        fused = _one_hot_native(kernels, list(range(len(ks))), works, ks, offsets,
                                Proposal(tokens, [None] * len(ks), []), logits)
        assert fused == _two_calls(kernels, works, ks, offsets, tokens, logits), case
    with pytest.raises(RuntimeError, match="sequence 0's 3 rows from row 2 are outside"):
        kernels.one_hot_acceptance(torch.zeros(4, 5), torch.tensor([2, 2, 0, 0, 1, 1]),
                                   torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="token 5 is outside the 5-token vocabulary"):
        kernels.one_hot_acceptance(torch.zeros(4, 5), torch.tensor([0, 1, 0, 0, 5]),
                                   torch.tensor([1.0]))


def test_native_greedy_tokens_are_torch_argmax():
    """kernels/cpu/sampling.cpp's greedy_tokens: torch.argmax's token for
    every row: ties to the first, a row all -inf, NaN (the first), widths
    not whole vectors, a strided view; bad logits refused by name."""
    kernels = _native()
    generator = torch.Generator().manual_seed(13)
    for vocab in (1, 7, 16, 33, 300, 49152, 262144):
        logits = torch.randn(6, vocab, generator=generator)
        logits[1] = logits[1].round()  # ties
        logits[2, vocab // 2:] = logits[2].max() + 1  # a tie of the largest
        logits[3] = float("-inf")
        logits[4, vocab - 1] = float("nan")
        logits[4, vocab // 3] = float("nan")
        logits[5, ::2] = float("-inf")
        assert kernels.greedy_tokens(logits).tolist() == logits.argmax(-1).tolist(), vocab
        assert greedy_tokens(logits[::2]) == logits[::2].argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="greedy_tokens: logits must be float32"):
        kernels.greedy_tokens(torch.zeros(2, 8, dtype=torch.float64))
    assert greedy_tokens(torch.zeros(0, 8)) == []  # no rows
