"""Incremental detokenization with SmolLM2's byte-level BPE tokenizer."""

import pytest

from specpage.detokenizer import IncrementalDetokenizer
from specpage.llm import load_tokenizer
from specpage.models.fetch import ensure_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_model("smollm2-135m"))


def feed(detok, ids):
    return [detok.add([t]) for t in ids]


def test_multibyte_characters_are_never_split(tokenizer):
    text = "héllo 世界 🎉 ok — naïve ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, [1, 2], stop=())
    deltas = feed(detok, ids)
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_cuts_the_text_and_is_held_back_until_decided(tokenizer):
    ids = tokenizer.encode("Hello world. STOP here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    emitted = ""
    for token in ids:
        emitted += detok.add([token])
        assert "S" not in emitted.replace("Hello world. ", "", 1)
        if detok.stopped:
            break
    assert detok.stopped and emitted == "Hello world. "
    assert detok.add(tokenizer.encode(" more", add_special_tokens=False)) == ""


def test_tokens_added_at_once_end_at_the_one_that_completes_the_stop_string(tokenizer):
    """Speculation accepts several tokens in a step: the output must end
    where one token per step would have ended it."""
    ids = tokenizer.encode("Hello world. STOP here and more", add_special_tokens=False)
    one_by_one = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    for token in ids:
        one_by_one.add([token])
        if one_by_one.stopped:
            break
    n = len(one_by_one.output_ids)
    at_once = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    text = at_once.add(ids[:2]) + at_once.add(ids[2:])
    assert at_once.stopped and 2 + at_once.used == n < len(ids)
    assert text == at_once.text == one_by_one.text == "Hello world. "
    assert at_once.output_ids == ids[:n]


def test_a_stop_prefix_that_never_completes_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("Say ST", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    emitted = "".join(feed(detok, ids))
    assert not detok.stopped and emitted == "Say "
    assert detok.flush() == "ST"


def test_spacing_follows_the_prompt(tokenizer):
    prompt = tokenizer.encode("The sky is", add_special_tokens=False)
    ids = tokenizer.encode(" blue today", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=())
    assert "".join(feed(detok, ids)) == " blue today"
