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


# Held-out requests of other kinds than the topics above (stories, code,
# lists, advice, explanations, rewriting, planning), written by hand: no
# training generator (draft/prompts.py, draft/chat.py) makes any of them.
MIXED = [
    "Tell me a story about a robot who learns to paint.",
    "Write a Python function that returns the n-th triangular number, with a docstring.",
    "List eight things to do on a rainy afternoon.",
    "My neighbour plays loud music every night. How can I bring it up politely?",
    "Why does bread go stale?",
    "Rewrite this so it sounds friendlier: \"Your order is late because you entered the"
    " wrong address.\"",
    "Plan a three-day trip to a city known for its museums.",
    "What is the difference between a virus and a bacterium?",
    "Write a limerick about a forgetful penguin.",
    "How do I center a div in CSS?",
    "Give me a weekly meal plan for a vegetarian student on a tight budget.",
    "Explain what a hash table is and when to use one.",
    "Write a cover letter opening for a junior data analyst position.",
    "I keep waking up at 3 a.m. What could help me sleep through the night?",
    "Summarize the plot of a fairy tale you know in five sentences.",
    "Write a JavaScript snippet that shuffles an array.",
    "What are some good questions to ask at the end of a job interview?",
    "Describe autumn in a forest to someone who has never seen it.",
    "How should I prepare for my first half marathon?",
    "Explain the rules of tic-tac-toe and one strategy to never lose.",
    "Write a dialogue between a customer and a waiter who mixed up an order.",
    "What is the Pythagorean theorem? Show one worked example.",
    "Suggest names for a small bakery that sells only sourdough bread.",
    "Write an SQL query that counts orders per customer and sorts them by that count.",
    "How can I stay focused while studying at home?",
    "Write a haiku sequence about a city waking up.",
    "What happens to a letter between the mailbox and the address on it?",
    "Turn these notes into a short paragraph: meeting moved to Friday, bring laptops,"
    " lunch provided.",
    "What are the pros and cons of electric scooters in cities?",
    "Explain to a beginner what a command line is and give three commands.",
    "Write a bedtime story about a turtle who wants to fly.",
    "How do I politely decline an invitation to a party?",
]


def mixed_prompts(count: int) -> list[str]:
    return [MIXED[i % len(MIXED)] for i in range(count)]
