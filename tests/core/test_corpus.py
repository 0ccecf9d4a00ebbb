"""The corpus proposer's table: what it keeps against a brute-force count of
its texts, its file read back as written, files that are not tables or not
the target's refused by name, and the proposer choosing it where the
context has no match."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpage.core.config_error import ConfigError
from specpage.core.corpus import MAGIC, CorpusTable, CorpusTableError, vocabulary_fingerprint
from specpage.core.engine_config import EngineConfig
from specpage.core.model_free import Method, ModelFreeProposer
from specpage.core.ngram import COUNT_CAP, SHRINK, Evidence
from specpage.core.request import SamplingParams
from specpage.models.corpus import corpus_table, packaged_tables
from tests.core.test_model_free import sequence

texts = st.lists(st.tuples(st.lists(st.integers(0, 4), max_size=40), st.integers(0, 3)),
                 max_size=6)


def brute_force_next(texts, context, n_max, least):
    """The table's answer by a rescan of every text: the likeliest follower
    (ties: the latest to reach the highest count) of the longest n-gram
    ending context that occurred, where n is 1 or that follower was seen at
    least `least` times; shorter n-grams otherwise."""
    for n in range(min(n_max, len(context)), 0, -1):
        gram = tuple(context[len(context) - n :])
        followers, best = Counter(), None
        for tokens, start in texts:
            for p in range(max(start, n), len(tokens)):
                if tuple(tokens[p - n : p]) == gram:
                    followers[tokens[p]] += 1
                    if best is None or followers[tokens[p]] >= followers[best]:
                        best = tokens[p]
        if followers and (n == 1 or followers[best] >= least):
            count, total = followers[best], sum(followers.values())
            return best, count / (total + SHRINK), Evidence(n, min(count, COUNT_CAP),
                                                             count == total)
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.lists(st.integers(0, 4), min_size=1, max_size=5), st.integers(1, 3),
       st.integers(1, 3))
def test_the_table_answers_as_a_rescan_of_its_texts(texts, context, n_max, least):
    table = CorpusTable.count(texts, "v", n_max=n_max, least=least)
    assert table.next_token(context) == brute_force_next(texts, context, n_max, least)
    assert table.tokens == sum(max(0, len(t) - s) for t, s in texts)


def test_a_table_reads_back_as_written(tmp_path):
    texts = [([1, 2, 3, 1, 2, 3, 1, 2, 4], 0), ([7, 1, 2, 3, 2**20 + 5, 9], 1)]
    table = CorpusTable.count(texts, "fingerprint", least=1)
    table.save(tmp_path / "t.bin")
    again = CorpusTable.load(tmp_path / "t.bin")
    assert again.tables == table.tables
    assert (again.fingerprint, again.tokens, again.n_max) == ("fingerprint", table.tokens, 3)
    assert CorpusTable.fingerprint_of(tmp_path / "t.bin") == "fingerprint"
    assert again.continuation([7, 1, 2], 3) == table.continuation([7, 1, 2], 3)
    assert again.next_token([3]) is not None


def test_a_walk_follows_the_model_s_habit_and_stops_where_the_table_knows_nothing():
    table = CorpusTable.count([([5, 6, 7, 8] * 3, 0)], "v")
    found = table.continuation([1, 5], 6)
    assert found.tokens == [6, 7, 8, 5, 6, 7]
    assert found.evidence[0] == Evidence(1, 3, True)
    assert table.continuation([9], 4).tokens == []


@pytest.mark.parametrize("content, problem", [
    (b"hello\n", "not a specpage n-gram table"),
    (MAGIC + b"{not json\n", "its header is unreadable"),
    (MAGIC + b'{"vocabulary": "v", "tokens": 1, "entries": [1]}\n' + b"\0" * 8,
     "8 bytes of tables where its header says 16"),
])
def test_a_file_that_is_not_a_whole_table_is_refused_by_name(tmp_path, content, problem):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(CorpusTableError, match=problem) as caught:
        CorpusTable.load(path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, ConfigError)  # the daemon reports it as a start-up error


class Vocabulary:
    """A tokenizer as far as a table's fingerprint is concerned."""

    def __init__(self, words):
        self.words = words

    def get_vocab(self):
        return {w: i for i, w in enumerate(self.words)}


def test_the_setting_takes_a_table_of_the_target_s_vocabulary_only(tmp_path):
    ours, theirs = Vocabulary(["a", "b", "c"]), Vocabulary(["a", "c", "b"])
    path = tmp_path / "ours.bin"
    CorpusTable.count([([0, 1, 2, 0, 1], 0)], vocabulary_fingerprint(ours)).save(path)
    assert corpus_table(str(path), ours).next_token([0]) is not None
    with pytest.raises(CorpusTableError, match=r"spec_corpus .*ours\.bin: a table of another "
                                               r"vocabulary"):
        corpus_table(str(path), theirs)
    with pytest.raises(CorpusTableError, match="missing.bin"):
        corpus_table(str(tmp_path / "missing.bin"), ours)
    assert corpus_table("", ours) is None
    assert corpus_table("auto", theirs) is None  # no table ships for it: the method is off


@pytest.mark.slow
def test_the_packaged_table_is_the_default_target_s():
    from transformers import AutoTokenizer

    from specpage.models.fetch import ensure_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))
    assert [p.parent.name for p in packaged_tables()] == ["smollm2-corpus"]
    table = corpus_table("auto", tokenizer)
    assert table is not None and table.tokens > 1_000_000
    ids = tokenizer("The compost piles were turned twice a")["input_ids"]
    assert tokenizer.decode(table.continuation(ids, 1).tokens) == " day"


def test_the_proposer_takes_the_corpus_where_the_context_has_no_match():
    table = CorpusTable.count([([10, 11, 12, 13], 0), ([10, 11, 12, 14], 0), ([10, 15], 0)], "v")
    config = EngineConfig(spec_methods="ngram,suffix,corpus")
    proposer = ModelFreeProposer(config, corpus=table)
    assert Method.CORPUS in proposer.methods
    found = proposer.propose(sequence([1, 2, 3, 10]))
    assert found is not None and found.method is Method.CORPUS
    assert found.tokens[:2] == [11, 12]
    # the context's own match wins where it promises more
    own = proposer.propose(sequence([10, 20, 21, 22, 10, 20, 21, 22, 10], seq_id=1))
    assert own is not None and own.method is Method.NGRAM and own.tokens[0] == 20
    # a seeded sample may use it too: no request's text is in it
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    assert proposer.propose(sequence([1, 10], seq_id=2, params=seeded)).method is Method.CORPUS
    assert Method.CORPUS not in ModelFreeProposer(config).methods  # no table: off
    assert Method.CORPUS not in ModelFreeProposer(
        EngineConfig(spec_methods="ngram"), corpus=table).methods


def test_unknown_methods_are_refused_and_corpus_is_known():
    assert EngineConfig().model_free_methods == ("ngram", "suffix", "corpus")
    with pytest.raises(ConfigError, match="unknown.*known: ngram, suffix, corpus"):
        EngineConfig(spec_methods="ngram,lookahead")

