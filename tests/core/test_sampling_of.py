"""What the core sends the executor of a sample's sampling parameters: its
history only when a penalty needs it, bans only below min_tokens, nothing
when every parameter is neutral."""

from specpage.core.request import Request, SamplingParams, Sequence
from specpage.core.step import Adjustments, sampling_of

PROMPT = (4, 5, 6)
EOS = (2,)


def sampling(output, **params):
    seq = Sequence(0, Request("r", PROMPT, SamplingParams(seed=9, **params)), 0,
                   list(PROMPT) + output)
    return sampling_of(seq, EOS)


def test_neutral_parameters_send_nothing():
    made = sampling([8], temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, logprobs=True)
    assert (made.temperature, made.top_k, made.top_p, made.seed, made.logprobs,
            made.min_p, made.adjustments) == (0.5, 3, 0.9, 9, True, 0.1, None)


def test_a_penalty_sends_the_history():
    made = sampling([8, 8], repetition_penalty=1.2, logit_bias={3: -1.0})
    assert made.adjustments == Adjustments(0.0, 0.0, 1.2, {3: -1.0}, 0, [], 3,
                                           [4, 5, 6, 8, 8])


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    below = sampling([8], min_tokens=2, stop_token_ids=(7,))
    assert below.adjustments == Adjustments(0.0, 0.0, 1.0, {}, 2, [7, 2], 3, [])
    assert sampling([8], min_tokens=2, ignore_eos=True).adjustments.banned == []
    assert sampling([8, 9], min_tokens=2).adjustments is None
    assert sampling([8, 9], min_tokens=2, logit_bias={1: 1.0}).adjustments.banned == []
