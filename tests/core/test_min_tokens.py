"""min_tokens in the stop rules: EOS, stop token ids and stop strings end
nothing before it, whether the tokens come one per step or several at once
(an accepted run of proposals)."""

import pytest

from specpage.core.detokenizer import IncrementalDetokenizer
from specpage.core.outputs import OutputProcessor
from specpage.core.request import FinishReason, Request, SamplingParams, Sequence
from specpage.engine.builder import load_tokenizer
from specpage.models.fetch import ensure_model

EOS = 7
PROMPT = (1, 2, 3)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_model("smollm2-135m"))


def stopped_after(tokenizer, ids, min_tokens, per_step):
    """(tokens the output keeps, its text) with stop string "STOP"."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",), min_tokens=min_tokens)
    kept, text = 0, ""
    for at in range(0, len(ids), per_step):
        step = ids[at : at + per_step]
        text += detok.add(step)
        kept += detok.used
        if detok.stopped:
            return kept, text
    return kept, text + detok.flush()


@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_a_stop_string_before_min_tokens_ends_nothing(tokenizer, per_step):
    ids = tokenizer.encode("One STOP two STOP three", add_special_tokens=False)
    first = next(n for n in range(1, len(ids) + 1)
                 if "STOP" in tokenizer.decode(ids[:n]))  # the token that completes it
    assert stopped_after(tokenizer, ids, 0, per_step) == (first, "One ")
    # from min_tokens on, the first stop string completed there ends the output
    assert stopped_after(tokenizer, ids, first, per_step) == (first, "One ")
    kept, text = stopped_after(tokenizer, ids, first + 1, per_step)
    assert text == "One STOP two " and "STOP" in tokenizer.decode(ids[:kept])
    assert "STOP two STOP" in tokenizer.decode(ids[:kept])
    assert "STOP two STOP" not in tokenizer.decode(ids[: kept - 1])


def output_of(tokens_per_step, min_tokens):
    ended = []
    processor = OutputProcessor(None, (EOS,), 100, lambda seq, reason: ended.append(reason))
    params = SamplingParams(max_tokens=10, min_tokens=min_tokens, stop_token_ids=(9,))
    seq = Sequence(0, Request("r", PROMPT, params), 0, list(PROMPT))
    for tokens in tokens_per_step:
        out = processor.append(seq, tokens, [])
        if out.finished:
            break
    return seq.output_token_ids, ended


@pytest.mark.parametrize("steps", [[[5], [EOS], [9], [EOS]], [[5, EOS, 9, EOS]]],
                         ids=["one-per-step", "at-once"])
def test_eos_and_stop_ids_end_the_output_only_past_min_tokens(steps):
    assert output_of(steps, 0) == ([5, EOS], [FinishReason.STOP])
    assert output_of(steps, 2) == ([5, EOS, 9], [FinishReason.STOP])
    assert output_of(steps, 3) == ([5, EOS, 9, EOS], [FinishReason.STOP])
    assert output_of(steps, 4) == ([5, EOS, 9, EOS], [])
