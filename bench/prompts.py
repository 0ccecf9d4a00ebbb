"""Chat prompts shared by the benchmarks (not used for training any draft)."""

TOPICS = [
    "the water cycle", "how vaccines work", "the French revolution", "black holes",
    "photosynthesis", "the stock market", "machine learning", "the Roman empire",
    "climate change", "how a car engine works", "the human heart", "volcanoes",
    "the internet", "honey bees", "the moon landing", "electricity",
    "the printing press", "earthquakes", "chess openings", "the immune system",
    "renewable energy", "ancient Egypt", "DNA", "the ocean tides",
    "coffee", "the Olympic games", "rainbows", "the piano",
    "democracy", "recycling", "jazz music", "the Great Wall of China",
]
STYLES = ["Explain {} to a child.", "Write a short paragraph about {}.",
          "Give three facts about {}.", "What should everyone know about {}?"]


def chat_prompts(count: int) -> list[str]:
    return [STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)]) for i in range(count)]
