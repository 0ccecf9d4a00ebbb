"""Varied training prompts: instruction templates over topic words taken from
the tokenizer's own vocabulary ("vocab"), or over everyday encyclopedic
topics (draft/topics.py, "curated"). The benchmark prompts (bench/prompts.py)
are held out: none of their topics is used here."""

from __future__ import annotations

import random
import re
from typing import Any

TEMPLATES = [
    "Explain {a} in simple terms.", "Write a short paragraph about {a}.",
    "Give three facts about {a}.", "What is the difference between {a} and {b}?",
    "Write a short poem about {a}.", "How would you describe {a} to a child?",
    "List some pros and cons of {a}.", "Tell me a short story involving {a} and {b}.",
    "Why is {a} important?", "What are common misconceptions about {a}?",
    "Write an email to a friend about {a}.", "Summarize the history of {a}.",
    "Give me tips for dealing with {a}.", "How are {a} and {b} related?",
    "Write a haiku about {a}.", "Describe a day in the life of someone who loves {a}.",
    "What questions should I ask about {a}?", "Explain how {a} works, step by step.",
    "Write a product description for something related to {a}.",
    "What would happen if there were no {a}?", "Define {a} and give an example.",
    "Compare {a}, {b} and {c}.", "Write a dialogue between two people about {a}.",
    "What is {a}? Answer in one sentence.", "Give advice to a beginner interested in {a}.",
    "Write a limerick about {a}.", "Translate the idea of {a} into a simple analogy.",
    "What are the main types of {a}?", "Write a motivational message mentioning {a}.",
    "Explain {a} as if you were a teacher.",
]
# More everyday requests, for the curated topics.
CHAT_TEMPLATES = TEMPLATES + [
    "Explain {a} to a child.", "What should everyone know about {a}?", "Tell me about {a}.",
    "Write a short essay about {a}.", "What are five interesting facts about {a}?",
]  # fmt: skip


def topic_words(tokenizer: Any, held_out: set[str]) -> list[str]:
    """Whole lower-case words of 5-12 letters that the tokenizer has as one token."""
    words = set()
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if re.fullmatch(r" [a-z]{5,12}", text):
            words.add(text.strip())
    return sorted(w for w in words if w not in held_out)


def training_prompts(words: list[str], count: int, seed: int,
                     templates: list[str] = TEMPLATES) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(templates).format(a=rng.choice(words), b=rng.choice(words),
                                         c=rng.choice(words)) for _ in range(count)]
