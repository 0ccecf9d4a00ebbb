"""The draft's training prompts keep the benchmark prompts held out."""

from bench.prompts import TOPICS, chat_prompts
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
