"""Penalties, min-p, logit bias and min_tokens, through the verifier on tiny
random fp32 checkpoints: greedy output with proposals equals output without
them, both equal transformers' logits adjusted by a plain reference, and
seeded sampling with proposals fits the exact adjusted distribution.

Each verified row sees the history it would have had, had the proposals
before it been accepted: a row that ignored them would pick other tokens
once a proposal is accepted, and these tests would see it.
"""

import math
from collections import Counter

import msgspec
import pytest
import torch

from specpage.core.request import Request, SamplingParams, Sequence
from specpage.core.step import SeqWork, sampling_of
from specpage.executor.model_runner import ModelRunner
from specpage.models.loader import load_model
from specpage.speculation.proposal import Proposal
from specpage.speculation.sampler import probabilities
from specpage.speculation.sampling_rows import adjusted_rows
from specpage.speculation.verifier import Verifier
from tests.speculation.test_sampling import ALPHA, VOCAB, chi_square_p
from tests.support.checkpoints import tiny_checkpoint

EOS = (7,)
BLOCK = 4
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ADJUSTED = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "negative-presence": dict(presence_penalty=-1.0),
    "logit-bias": dict(logit_bias={5: 3.0, 17: 2.5, 40: -100.0}),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                logit_bias={9: 1.0}, min_p=0.2),
}


def reference_logits(logits, params, prompt, output, eos=EOS):
    """The row's logits as vLLM adjusts them, one token at a time."""
    logits = logits.clone()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    if len(output) < params.min_tokens:
        for token in list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos)):
            logits[token] = -math.inf
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token, count in Counter(output).items():
        logits[token] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def reference_probs(logits, params, prompt, output):
    adjusted = reference_logits(logits, params, prompt, output)
    return probabilities(adjusted[None], torch.tensor([params.temperature]),
                         torch.tensor([params.top_k]), torch.tensor([params.top_p]),
                         torch.tensor([params.min_p]))[0]


def test_each_row_is_adjusted_as_if_the_proposal_before_it_were_accepted():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3  # positive and negative logits
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3,
                            repetition_penalty=1.7, logit_bias={3: 5.0, 4: -2.0}, min_tokens=3,
                            stop_token_ids=(9,), ignore_eos=False)
    prompt, output, proposal = [1, 2, 3], [4, 5], [4, 9, 6]
    seq = Sequence(0, Request("r", tuple(prompt), params), 0, prompt + output)
    rows = [sampling_of(seq, EOS)] * 4
    adjusted = adjusted_rows(logits, rows, [5 + j for j in range(4)],
                             [proposal[:j] for j in range(4)])
    for j in range(4):
        expected = reference_logits(logits[j], params, prompt, output + proposal[:j])
        torch.testing.assert_close(adjusted[j], expected)
    assert adjusted[0, 9] == adjusted[0, 7] == -math.inf  # below min_tokens
    assert math.isfinite(adjusted[1, 9]) and math.isfinite(adjusted[1, 7])
    neutral = sampling_of(Sequence(1, Request("n", (1,), SamplingParams()), 0, [1]), EOS)
    assert adjusted_rows(logits, [neutral] * 4, [1] * 4, [[]] * 4) is logits


def test_min_p_drops_tokens_under_its_share_of_the_likeliest_after_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2)
    probs = probabilities(logits, torch.tensor([0.5, 1.0]), torch.tensor([0, 0]),
                          torch.tensor([1.0, 1.0]), torch.tensor([0.1, 0.1]))
    sharp = torch.softmax(logits[0] / 0.5, -1)  # 0.867, 0.117, 0.016, 0.002
    torch.testing.assert_close(probs[0], torch.cat([sharp[:2] / sharp[:2].sum(),
                                                    torch.zeros(2)]))
    flat = torch.softmax(logits[1], -1)  # 0.644, 0.237, 0.087, 0.032
    torch.testing.assert_close(probs[1], torch.cat([flat[:3] / flat[:3].sum(), torch.zeros(1)]))


def hf_decode(hf, prompt, params, max_new):
    """Greedy decoding from transformers' logits through reference_logits."""
    output = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(reference_logits(logits, params, prompt, output).argmax()))
    return output


class Decoder:
    """Verification steps by hand: one block range per sequence, its KV
    written at each step's positions; rejected positions are overwritten
    by a later step, as in the engine."""

    def __init__(self, loaded, num_seqs, max_len):
        self.blocks = -(-max_len // BLOCK)
        self.verifier = Verifier(ModelRunner(loaded, num_seqs * self.blocks, BLOCK))

    def run(self, prompts, params, max_new, propose=lambda seq: []):
        """Every prompt decoded to max_new tokens; params: one for all or
        one per prompt; propose(seq) -> the core's proposal for seq this step."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [Sequence(i, Request(str(i), tuple(p), q), 0, list(p))
                for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
        computed = [0] * len(seqs)
        while any(len(s.output_token_ids) < max_new for s in seqs):
            live = [i for i, s in enumerate(seqs) if len(s.output_token_ids) < max_new]
            batch = [self._work(seqs[i], computed[i], propose(seqs[i])) for i in live]
            verdict = self.verifier.verify(batch, Proposal.none(len(batch)).with_core(batch))
            for i, w, done in zip(live, batch, verdict.results, strict=True):
                seqs[i].token_ids.extend(done.tokens)
                computed[i] = w.end + done.num_accepted
        return [s.output_token_ids[:max_new] for s in seqs]

    def _work(self, seq, start, proposal):
        table = list(range(seq.seq_id * self.blocks, (seq.seq_id + 1) * self.blocks))
        return SeqWork(seq.seq_id, start, seq.token_ids[start:], table, True, len(proposal),
                       start, [], sampling_of(seq, EOS), proposal=list(proposal))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    hf = tiny_checkpoint(root / "target")
    return hf, Decoder(load_model(root / "target"), 2, 96)


# a repetitive prompt: what follows each token is in the context already
PROMPTS = [[11, 5, 23, 9, 40] * 4, [3, 17, 3, 17, 8, 3, 17, 3]]


def oracle(outputs, spoil, length=3):
    """Proposals from the known output: its next `length` tokens, the last
    spoiled every `spoil` steps, so that runs are accepted and cut."""
    step = Counter()

    def propose(seq):
        done, expected = len(seq.output_token_ids), outputs[seq.seq_id]
        step[seq.seq_id] += 1
        proposal = list(expected[done : done + length])
        if len(proposal) == length and step[seq.seq_id] % spoil == 0:
            proposal[-1] = (proposal[-1] + 1) % 211
        return proposal

    return propose


def prompt_lookup(seq):
    """The tokens after the newest token's last earlier occurrence, up to 3."""
    tokens = seq.token_ids
    for at in range(len(tokens) - 2, -1, -1):
        if tokens[at] == tokens[-1]:
            return tokens[at + 1 : at + 4]
    return []


@pytest.mark.parametrize("adjust", list(ADJUSTED), ids=list(ADJUSTED))
def test_greedy_with_proposals_equals_without_and_transformers(tiny, adjust):
    hf, decoder = tiny
    params = msgspec.structs.replace(GREEDY, **ADJUSTED[adjust])
    plain = decoder.run(PROMPTS, params, 20)
    assert plain == [hf_decode(hf, p, params, 20) for p in PROMPTS]
    assert plain != decoder.run(PROMPTS, GREEDY, 20)  # the parameters change the output
    assert decoder.run(PROMPTS, params, 20, oracle(plain, spoil=2)) == plain
    assert decoder.run(PROMPTS, params, 20, prompt_lookup) == plain


def test_min_tokens_bans_eos_and_stop_ids_until_reached(tiny):
    hf, decoder = tiny
    # a bias that would pick EOS (7) and the stop id 23 first, were they allowed
    params = msgspec.structs.replace(
        GREEDY, ignore_eos=False, stop_token_ids=(23,), min_tokens=4,
        logit_bias={7: 50.0, 23: 40.0})
    plain = decoder.run(PROMPTS, params, 6)
    assert plain == [hf_decode(hf, p, params, 6) for p in PROMPTS]
    for output in plain:
        assert 7 not in output[:4] and 23 not in output[:4]
        assert output[4] == 7
    # proposed, and rejected, until min_tokens
    assert decoder.run(PROMPTS, params, 6, lambda seq: [7, 23, 7]) == plain
    # EOS proposed after the proposal before it reaches min_tokens: accepted
    assert decoder.run(PROMPTS, params, 6, oracle(plain, spoil=5, length=2)) == plain


def spread_model(folder, seed):
    """An 8-token vocabulary, logits spread enough for penalties to move them."""
    hf = tiny_checkpoint(folder, seed=seed, vocab_size=VOCAB, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    return spread_model(root / "t", seed=0), load_model(root / "t")


RUNS = 4000


def exact_pairs(hf, params, prompt):
    """P(x1, x2) of the first two sampled tokens, each adjusted by what came before."""
    def dist(output):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1]
        return reference_probs(logits, params, prompt, output).double()
    p1 = dist([])
    return torch.cat([p1[x1] * dist([x1]) for x1 in range(VOCAB)])


SAMPLED = {
    "penalties": SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6,
                                repetition_penalty=2.0),
    "min-p-bias": SamplingParams(temperature=0.9, min_p=0.05, logit_bias={1: 2.0, 4: -1.5}),
}


@pytest.mark.parametrize("name", list(SAMPLED), ids=list(SAMPLED))
def test_sampling_with_proposals_fits_the_adjusted_distribution(small, name):
    """Model-free proposals (q one-hot) of the tokens the penalties punish
    most: accepted with the adjusted p, else drawn from it without them."""
    hf, loaded = small
    prompt = [1, 2, 3, 2, 1]
    params = SAMPLED[name]
    exact = exact_pairs(hf, params, prompt)
    assert 0.5 * (exact - exact_pairs(hf, SamplingParams(), prompt)).abs().sum() > 0.1
    seeded = [msgspec.structs.replace(params, seed=s, ignore_eos=True) for s in range(RUNS)]
    # prompt tokens, which the repetition penalty punishes and the bias moves
    propose = lambda seq: [2, 1][len(seq.output_token_ids) :]  # noqa: E731
    outputs = Decoder(loaded, RUNS, 16).run([prompt] * RUNS, seeded, 2, propose)
    counts = Counter(x1 * VOCAB + x2 for x1, x2 in outputs)
    observed = torch.tensor([counts[i] for i in range(VOCAB * VOCAB)], dtype=torch.float64)
    assert chi_square_p(observed, exact) > ALPHA
