"""Incremental detokenization with SmolLM2's byte-level BPE tokenizer, and
against the scanning detokenizer it replaced, on a byte-level toy vocabulary."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpage.core.detokenizer import PROMPT_CONTEXT, IncrementalDetokenizer
from specpage.engine.builder import load_tokenizer
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


class ByteTokenizer:
    """Token ids are byte strings, decoded as one, bad bytes to U+FFFD: what
    a byte-level BPE tokenizer does, including characters split over tokens."""

    PIECES = (b"a", b"b", b" ", b"ab", b"ba ", b"\n", b"\xc3", b"\xa9", b"\xc3\xa9",
              b"\xe4", b"\xb8", b"\x96", b"\xe4\xb8\x96", b"\xff")

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


class ScanningDetokenizer:
    """The reference: searches the text for every stop string at every step."""

    def __init__(self, tokenizer, prompt_ids, stop):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.context = list(prompt_ids[-PROMPT_CONTEXT:])
        self.context_text = self.tokenizer.decode(self.context).rstrip("\ufffd")
        self.output_ids, self.text, self.emitted, self.stopped, self.used = [], "", 0, False, 0

    def add(self, token_ids):
        self.used = 0
        if self.stopped:
            return ""
        base = len(self.output_ids)
        self.output_ids.extend(token_ids)
        self.used = len(token_ids)
        self.text = complete = self._complete_text()
        hold = 0
        if self.stop:
            start = max(0, self.emitted - max(map(len, self.stop)))
            if first_hit(complete, self.stop, start) is not None:
                for n in range(1, len(token_ids) + 1):
                    self.output_ids[base:] = token_ids[:n]
                    complete = self._complete_text()
                    if (hit := first_hit(complete, self.stop, start)) is not None:
                        break
                self.used, self.text, self.stopped = n, complete[:hit], True
            else:
                hold = max((n for s in self.stop
                            for n in range(1, min(len(s) - 1, len(complete)) + 1)
                            if complete.endswith(s[:n])), default=0)
        return self.flush(len(self.text) - hold)

    def _complete_text(self):
        full = self.tokenizer.decode(self.context + self.output_ids)
        return full[len(self.context_text) :].rstrip("\ufffd")

    def flush(self, upto=None):
        upto = len(self.text) if upto is None else upto
        delta = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return delta


def first_hit(text, stops, start):
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


token_ids = st.integers(0, len(ByteTokenizer.PIECES) - 1)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(token_ids, max_size=5),
    steps=st.lists(st.lists(token_ids, max_size=4), max_size=12),
    stop=st.lists(st.text("ab é世\n", min_size=1, max_size=4), max_size=5),
)
def test_same_deltas_cuts_and_used_tokens_as_scanning_every_stop_string(prompt, steps, stop):
    """Overlapping and nested stop strings, characters split over tokens and
    over the prompt's end, several tokens a step: every delta, `used`, the
    cut text and the flushed tail equal the scanning reference's."""
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    reference = ScanningDetokenizer(tokenizer, prompt, stop)
    for step in steps:
        assert detok.add(step) == reference.add(step)
        assert (detok.used, detok.stopped, detok.text) == (
            reference.used, reference.stopped, reference.text)
        assert detok.output_ids == reference.output_ids
    assert detok.flush() == reference.flush()


class CountingStr(str):
    """A stop string that counts how often Python code reads it."""

    reads = 0

    def __len__(self):
        CountingStr.reads += 1
        return super().__len__()

    def __getitem__(self, key):
        CountingStr.reads += 1
        return super().__getitem__(key)

    def __iter__(self):
        CountingStr.reads += 1
        return super().__iter__()


def test_a_step_reads_no_stop_string(tokenizer):
    """Stop strings are compiled once; a step's work does not grow with their number."""
    ids = tokenizer.encode("Hello world. STOP here", add_special_tokens=False)
    rng = random.Random(0)
    stops = [CountingStr("".join(rng.choice("STOPxyz") for _ in range(6))) for _ in range(1000)]
    detok = IncrementalDetokenizer(tokenizer, [], stop=[*stops, CountingStr("STOP")])
    CountingStr.reads = 0
    emitted = "".join(feed(detok, ids[:-1]))
    assert detok.stopped and emitted == "Hello world. "
    assert CountingStr.reads == 0


def test_matcher_work_is_bounded_by_the_text_not_the_stop_strings(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(1)
    words = text.split()
    work = {}
    for count in (10, 10_000):
        # prefixes of the text's own words, which never end in '#': deep partial matches
        stops = [rng.choice(words)[: rng.randint(1, 5)] + "#" for _ in range(count)]
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
        for step in range(0, len(ids), 3):
            detok.add(ids[step : step + 3])
        assert not detok.stopped and detok.text == text
        work[count] = detok.matcher.transitions
    # one transition a character, plus failure links that never outnumber them
    assert len(text) <= work[10] <= 2 * len(text)
    assert len(text) <= work[10_000] <= 2 * len(text)


class CountingTokenizer:
    """SmolLM2's tokenizer, counting the tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_step_decodes_the_tokens_since_the_last_whole_text_not_the_whole_output(tokenizer):
    """The work of a step does not grow with the output's length: with one
    token a step, a window holds the tokens of the last two steps."""
    text = "The quick brown fox jumps over the lazy dog, naïvely. " * 40
    ids = tokenizer.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("Say:"), stop=("#",))
    counting.calls.clear()
    emitted = "".join(feed(detok, ids)) + detok.flush()
    assert emitted == text and len(ids) > 400
    assert max(counting.calls) <= PROMPT_CONTEXT + 2


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-2-style tokenizer, built here: BPE over words marked by '▁',
    bytes for characters it lacks, and a decoder that drops the text's first
    space, so that decoding is not the concatenation of the tokens' pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld, naïve café",
              "a stop here and there", "numbers 12 345 6789"] * 20
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    vocab = trained.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in __import__("json").loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prompt=st.text("ab é世 🎉\n", max_size=6), output=st.text("ab é世 🎉\nthe fox", max_size=40),
       cuts=st.lists(st.integers(1, 4), max_size=30),
       stop=st.lists(st.text("ab é世", min_size=1, max_size=3), max_size=3))
def test_a_tokenizer_whose_decoding_is_not_concatenation_gives_the_whole_decode(
        sentencepiece_like, prompt, output, cuts, stop):
    """Deltas, cuts at stop strings and the flushed tail equal those of
    decoding the whole output every step, with characters split over byte
    tokens and the decoder's dropped first space. (The text between steps
    may differ: decoding the whole output turns a character already whole
    back into U+FFFDs while bytes of the next one are missing, which this
    byte fallback does, and so releases nothing until they come.)"""
    ids = sentencepiece_like.encode(output, add_special_tokens=False)
    prompt_ids = sentencepiece_like.encode(prompt, add_special_tokens=False)
    detok = IncrementalDetokenizer(sentencepiece_like, prompt_ids, stop)
    reference = ScanningDetokenizer(sentencepiece_like, prompt_ids, stop)
    at = 0
    for size in [*cuts, len(ids)]:
        step, at = ids[at:at + size], at + size
        assert detok.add(step) == reference.add(step)
        assert (detok.used, detok.stopped) == (reference.used, reference.stopped)
    assert detok.flush() == reference.flush()
    assert detok.text == reference.text
