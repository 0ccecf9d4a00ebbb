"""Broad chat requests for training drafts and heads: the kinds of request a
chat server gets (explanations, lists, stories, code, advice, rewriting,
planning, comparisons, multi-turn follow-ups), made from templates over
fillers written here. Rewriting requests work on sentences taken from
earlier answers of the target (the data shards), so their texts vary as
much as those answers do.

None of these templates is a phrasing of the held-out prompts
(bench/prompts.py), and no filler is one of their topics.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

THINGS = [
    "a bicycle", "a refrigerator", "a thermostat", "a solar panel", "a microwave oven",
    "a compass", "a lighthouse", "a camera", "a password manager", "a search engine",
    "a credit card", "a smoke detector", "an elevator", "a GPS receiver", "a water filter",
    "a battery", "a heat pump", "a barcode scanner", "a sewing machine", "a telescope",
    "a spreadsheet", "a library card catalogue", "a washing machine", "a parachute",
    "a wind turbine", "a pressure cooker", "a loudspeaker", "a zipper", "an umbrella",
    "a traffic light", "a dishwasher", "a submarine", "a hot air balloon", "a vending machine",
]
CONCEPTS = [
    "inflation", "compound interest", "supply and demand", "opportunity cost", "entropy",
    "gravity", "natural selection", "the placebo effect", "confirmation bias", "recursion",
    "encryption", "a budget", "habit formation", "procrastination", "public speaking",
    "time zones", "leap years", "the scientific method", "peer review", "copyright",
    "a mortgage", "insurance", "taxes", "a credit score", "the food chain", "erosion",
    "friction", "momentum", "buoyancy", "sound waves", "magnetism", "fermentation",
    "composting", "meditation", "sleep cycles", "muscle memory", "nutrition labels",
    "probability", "statistics", "averages", "percentages", "fractions", "prime numbers",
    "version control", "databases", "cloud storage", "operating systems", "compilers",
    "web browsers", "email", "open source software", "unit testing", "API design",
    "time management", "negotiation", "teamwork", "leadership", "empathy", "critical thinking",
]
PEOPLE = [
    "a retired sailor", "a shy librarian", "a young inventor", "a grumpy baker",
    "a curious robot", "a lost puppy", "an old lighthouse keeper", "a teenage skateboarder",
    "a nervous astronaut", "a street musician", "a village doctor", "a talking cat",
    "a new teacher", "a clumsy wizard", "a farmer", "a detective", "a gardener",
    "a night-shift nurse", "two rival chefs", "a brother and sister", "a mail carrier",
    "a dragon who is afraid of fire", "a ghost in an empty house", "a mountain guide",
]
EVENTS = [
    "finds a mysterious map", "loses something important", "makes an unlikely friend",
    "has to give a speech", "gets stuck in a storm", "discovers a secret door",
    "learns to say no", "wins a small contest", "misses the last train home",
    "tries to fix a broken machine", "receives a letter from the past",
    "moves to a new city", "plants a garden", "helps a stranger", "forgets a birthday",
    "builds something from scratch", "goes on a first trip abroad", "solves a puzzle",
]
SETTINGS = [
    "a small seaside town", "a space station", "a busy market", "a snowy mountain village",
    "a futuristic city", "a quiet forest", "an old castle", "a school", "a desert",
    "a train", "a hospital at night", "an island",
]
GOALS = [
    "sleep better", "save money each month", "learn a new language", "get fit at home",
    "stop procrastinating", "cook healthier meals", "prepare for a job interview",
    "make new friends in a new city", "study for exams", "keep houseplants alive",
    "reduce stress at work", "read more books", "start running", "organise my week",
    "write a good resume", "be more confident", "learn to code", "travel on a budget",
    "deal with a difficult coworker", "keep my apartment tidy", "drink more water",
    "remember names", "improve my handwriting", "take better photos with my phone",
    "start a small business", "ask for a raise", "learn to play guitar", "eat less sugar",
]
FEELINGS = ["nervous", "overwhelmed", "bored", "stuck", "unmotivated", "worried", "lonely"]
SITUATIONS = [
    "starting a new job", "moving house", "my exams next week", "a presentation at work",
    "a big decision", "a conflict with a friend", "my first marathon", "a long flight",
    "learning to drive", "my finances", "working from home",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "finds the largest number in a list", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "computes the factorial of a number", "returns the Fibonacci numbers up to n",
    "sorts a list of names alphabetically", "merges two sorted lists",
    "counts how often each letter appears", "reads a file and prints its lines",
    "validates an email address", "computes the average of a list of numbers",
    "finds the second smallest element", "flattens a nested list", "capitalises each word",
    "checks whether two strings are anagrams", "converts a number to binary",
    "returns the sum of the digits of a number", "groups words by their first letter",
    "implements binary search", "computes the greatest common divisor",
    "parses a date string", "generates a random password", "rotates a list by k places",
]
LANGUAGES = ["Python", "JavaScript", "C", "Java", "Go", "Rust", "Ruby", "TypeScript"]
CODE_TOPICS = [
    "a for loop", "a dictionary", "a class", "an exception", "a list comprehension",
    "a recursive function", "a hash map", "a linked list", "a stack", "a queue",
    "a pointer", "a closure", "a SQL join", "a regular expression", "a unit test",
    "a REST API", "a git branch", "a lambda function", "asynchronous code", "a binary tree",
]
SNIPPETS = [
    "for i in range(5):\n    print(i * i)",
    "def add(a, b):\n    return a + b",
    "x = [n for n in range(10) if n % 2 == 0]",
    "SELECT name FROM users WHERE age > 30;",
    "while count < 10:\n    count += 1",
    "const total = items.reduce((a, b) => a + b, 0);",
    "if (x > 0) { printf(\"positive\"); }",
    "words = text.split()\nprint(len(words))",
    "with open('data.txt') as f:\n    lines = f.readlines()",
    "numbers.sort(reverse=True)",
]
OCCASIONS = [
    "a birthday party", "a team meeting", "a weekend trip", "a picnic", "a wedding toast",
    "a school project", "a garage sale", "a family dinner", "a book club", "a job fair",
]
OBJECTS = [
    "fruits", "board games", "hobbies", "houseplants", "breakfast ideas", "dog breeds",
    "ways to reuse glass jars", "questions for a job interview", "names for a cat",
    "things to pack for camping", "habits of successful students", "indoor activities",
    "careers in science", "snacks for a road trip", "ways to save energy at home",
    "famous inventions", "kinds of clouds", "musical instruments", "exercises for beginners",
]
CHOICES = [
    ("cats", "dogs"), ("tea", "hot chocolate"), ("renting", "buying a home"), ("trains", "planes"),
    ("paper books", "e-books"), ("Python", "JavaScript"), ("running", "swimming"),
    ("city life", "country life"), ("working from home", "working in an office"),
    ("saving", "investing"), ("a laptop", "a desktop computer"), ("summer", "winter"),
]
REWRITES = [
    "Rewrite this sentence in a more formal tone: \"{s}\"",
    "Make this sentence simpler: \"{s}\"", "Paraphrase the following: {s}",
    "Fix any grammar mistakes in this sentence: {s}", "Translate into French: {s}",
    "Turn this into a question: {s}", "Summarize in a few words: {s}",
    "Make this sound more exciting: {s}", "Rewrite this for a ten-year-old: {s}",
    "Shorten this sentence: {s}", "What is the main idea of this sentence? {s}",
    "Continue this text with two more sentences: {s}",
]
TEMPLATES = [
    "How does {thing} work?", "What is {concept}? Give an example.",
    "Can you explain {concept} in a few sentences?", "Why do people use {thing}?",
    "Explain {concept} using an everyday analogy.", "What are the main parts of {thing}?",
    "Write a short story about {person} who {event}.",
    "Write a story set in {setting} about {person}.",
    "Tell me a bedtime story about {person}.",
    "Write the opening paragraph of a novel set in {setting}.",
    "Write a poem about {person} in {setting}.",
    "How can I {goal}?", "Give me five tips to {goal}.", "I want to {goal}. Where do I start?",
    "I feel {feeling} about {situation}. What should I do?",
    "What is a good plan to {goal} in one month?",
    "Write a {language} function that {task}.", "How do I write code that {task} in {language}?",
    "Explain {code_topic} in {language} with a small example.",
    "What does this code do?\n```\n{snippet}\n```",
    "Find the bug in this code, if any:\n```\n{snippet}\n```",
    "List ten {objects}.", "Make a checklist for {occasion}.",
    "Give me a list of {objects} with one sentence each.",
    "Suggest some {objects} for a beginner.", "Plan {occasion} for me.",
    "Which is better, {a} or {b}?", "Compare {a} and {b} in a table.",
    "What are the advantages of {a} over {b}?",
    "Write a short email inviting colleagues to {occasion}.",
    "Write a thank-you note for {occasion}.", "Write a tweet about {concept}.",
    "Write a short speech for {occasion}.",
    "Answer briefly: what is {concept}?", "Quiz me on {concept} with three questions.",
    "Summarize what you know about {concept} in three bullet points.",
    "What mistakes do beginners make with {concept}?",
]  # fmt: skip
# Added to a request now and then: who it is for, how long, in what form.
ASIDES = [
    " Keep it short.", " Use bullet points.", " Explain it for a beginner.",
    " Answer in two paragraphs.", " Be specific.", " Use a friendly tone.",
    " I am a student.", " Please be brief.", " Give reasons.", " Include an example.",
    " Write it for a ten-year-old.", " Make it funny.", " Use simple words.",
    " I have about ten minutes a day.", " Number the steps.",
]
FOLLOW_UPS = [
    "Can you make that shorter?", "Give me an example.", "Can you explain that more simply?",
    "Thanks! Can you add two more points?", "Why is that?", "Can you put that in a list?",
    "What would you change to make it better?", "Can you say more about the first point?",
    "Now write it in a friendlier tone.", "Is there anything I should avoid?",
]


@dataclass(frozen=True)
class Request:
    """One user turn, and optionally a follow-up asked after the answer."""

    text: str
    follow_up: str | None = None


def sentences(answers_text: list[str]) -> list[str]:
    """Whole sentences of 6-30 words from earlier answers, for rewriting."""
    found = []
    for text in answers_text:
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            words = sentence.split()
            if 6 <= len(words) <= 30 and sentence[0].isupper() and sentence[-1] in ".!?":
                found.append(sentence.strip())
    return found


def chat_requests(count: int, seed: int, rewrite_sources: list[str],
                  follow_up_fraction: float = 0.2, topics: list[str] = ()) -> list[Request]:
    """`count` distinct requests. `topics`: more things to explain and write
    about (e.g. draft/topics.py), used beside CONCEPTS and THINGS."""
    rng = random.Random(seed)
    concepts = CONCEPTS + list(topics)
    requests: list[Request] = []
    seen: set[str] = set()
    attempts = 0
    while len(requests) < count and attempts < 20 * count:
        attempts += 1
        if rewrite_sources and rng.random() < 0.15:
            text = rng.choice(REWRITES).format(s=rng.choice(rewrite_sources))
        else:
            a, b = rng.choice(CHOICES)
            text = rng.choice(TEMPLATES).format(
                thing=rng.choice(THINGS), concept=rng.choice(concepts),
                person=rng.choice(PEOPLE), event=rng.choice(EVENTS),
                setting=rng.choice(SETTINGS), goal=rng.choice(GOALS),
                feeling=rng.choice(FEELINGS), situation=rng.choice(SITUATIONS),
                language=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS),
                code_topic=rng.choice(CODE_TOPICS), snippet=rng.choice(SNIPPETS),
                objects=rng.choice(OBJECTS), occasion=rng.choice(OCCASIONS), a=a, b=b)
            if rng.random() < 0.4:
                text += rng.choice(ASIDES)
        if text in seen:
            continue
        seen.add(text)
        follow = rng.choice(FOLLOW_UPS) if rng.random() < follow_up_fraction else None
        requests.append(Request(text, follow))
    return requests
