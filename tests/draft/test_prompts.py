"""The draft's training prompts keep the benchmark prompts held out."""

from bench.prompts import MIXED, TOPICS, chat_prompts
from draft.chat import REWRITES, TEMPLATES, chat_requests, sentences
from draft.prompts import CHAT_TEMPLATES, training_prompts
from draft.topics import curated_topics

HELD_OUT = {w.lower() for topic in TOPICS for w in topic.split()}


def content_words(text: str) -> set[str]:
    words = {w.lower().strip(".,?!'").removesuffix("'s") for w in text.split()}
    return {w.removesuffix("s") for w in words if len(w) >= 3}


def test_no_curated_topic_shares_a_word_with_a_benchmark_topic():
    topics = curated_topics(HELD_OUT)
    assert len(topics) > 300
    benchmark = content_words(" ".join(TOPICS)) - {"the", "and", "how", "work"}
    for topic in topics:
        assert not content_words(topic) & benchmark, topic
    assert "the Vikings" in topics and "vaccines for pets" not in topics


def test_no_training_prompt_is_a_benchmark_prompt():
    prompts = set(training_prompts(curated_topics(HELD_OUT), 20_000, 0, CHAT_TEMPLATES))
    assert len(prompts) > 5_000
    assert not prompts & set(chat_prompts(len(TOPICS) * 4))


def test_the_broad_requests_make_no_held_out_prompt_and_vary():
    sources = ["The river carried small stones far downstream every spring.",
               "Too short.", "bad start without a capital letter at all here."]
    requests = chat_requests(20_000, 0, sentences(sources), topics=curated_topics(HELD_OUT))
    texts = {r.text for r in requests}
    assert len(texts) == len(requests) == 20_000  # distinct: a greedy answer repeats
    assert not texts & set(MIXED) and not texts & set(chat_prompts(len(TOPICS) * 4))
    # the mixed prompts are of other phrasings than any template
    templates = {t.split("{")[0] for t in [*TEMPLATES, *REWRITES]}
    assert not {m for m in MIXED for t in templates if t and m.startswith(t) and len(t) > 12}
    assert any("Paraphrase the following: The river" in t for t in texts)  # rewriting
    assert not any("Too short" in t or "bad start" in t for t in texts)
    follow_ups = [r for r in requests if r.follow_up]
    assert 0.1 < len(follow_ups) / len(requests) < 0.3
    for topic in TOPICS:  # no filler is a benchmark topic
        assert not any(f" {topic}." in t or f" {topic}?" in t for t in texts), topic
