"""The chaos run's chat questions: a fixed list of questions times a fixed list of
variations, so request ``i`` always asks the same thing and the greedy reference needs one
generation per distinct question."""

from __future__ import annotations

QUESTIONS = (
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me a fun fact about owls.",
    "What does a compiler do?",
    "List two uses of copper.",
    "Why is the sky blue?",
    "Describe a cat in three words.",
    "What is a prime number?",
    "How do plants make food?",
)
VARIATIONS = (
    "",
    " Answer briefly.",
    " Explain it to a child.",
    " Answer in one sentence.",
    " Start your answer with 'Well,'.",
)


CONTEXT_SENTENCE = "The archive keeps records of ships, harbours, tides and storms. "


def context(words: int) -> str:
    """A shared preamble of about ``words`` words (``--context-words``): requests that open
    with it share their leading KV blocks, which the KV store then serves across workers.

    >>> context(0), len(context(100).split()) >= 100
    ('', True)
    """
    if words <= 0:
        return ""
    sentence_words = len(CONTEXT_SENTENCE.split())
    return CONTEXT_SENTENCE * -(-words // sentence_words) + "\n\n"


def question(index: int) -> str:
    """The question of request ``index``: every question once, then the next variation.

    >>> question(0), question(12)
    ('What is the capital of France?', 'What is the capital of France? Answer briefly.')
    """
    q = QUESTIONS[index % len(QUESTIONS)]
    return q + VARIATIONS[(index // len(QUESTIONS)) % len(VARIATIONS)]
