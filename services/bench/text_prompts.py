"""English prompts of a given token length, for benchmarks where the model's answers matter.

Random token ids are fine where only lengths matter (memory breakdowns, latency), but not where
the outputs do: on a prompt of random ids a model is unsure of every next token, so beam search
keeps beams that differ early and share little. A window of real text of the trace's length
keeps the trace's length distribution and gives the model something to continue.
"""

from __future__ import annotations

import functools
import random
from typing import Any

# Instruction-style sentences in the manner of the Alpaca dataset (written for this benchmark).
INSTRUCTIONS = (
    "Give three tips for staying healthy.",
    "What are the three primary colors?",
    "Describe the structure of an atom.",
    "How can we reduce air pollution in large cities?",
    "Explain why the sky is blue during the day and red at sunset.",
    "Write a short story about a dog that finds its way home.",
    "Summarize the main causes of the French Revolution.",
    "List five unusual uses for a paperclip.",
    "Explain the difference between weather and climate.",
    "Write a haiku about the first snow of winter.",
    "Suggest a name for a small coffee shop near a university.",
    "Describe the process of photosynthesis in simple terms.",
    "What is the capital of Australia, and why was it chosen?",
    "Compare the advantages of trains and airplanes for travel.",
    "Write a polite email asking a colleague to review a report.",
    "Explain how a bicycle stays upright while moving.",
    "Give an example of a metaphor and explain its meaning.",
    "Describe a typical day in the life of a lighthouse keeper.",
    "Why do leaves change color in the autumn?",
    "Outline the steps to bake a loaf of bread at home.",
    "Explain what a database index is and when to use one.",
    "Write a limerick about a cat who loves to sleep.",
    "What are the benefits of learning a second language?",
    "Describe the water cycle and its main stages.",
    "Convert the following sentence into the passive voice: the chef cooked the meal.",
    "Suggest three ways to save energy in the kitchen.",
    "Explain the rules of chess to a ten year old.",
    "Write a product description for a waterproof hiking backpack.",
    "What are the main differences between a virus and a bacterium?",
    "Describe the sound of the ocean to someone who has never heard it.",
    "Plan a three day trip to Rome for a family with two children.",
    "Explain why regular exercise improves sleep.",
)


@functools.cache
def _corpus_ids(tokenizer: Any) -> tuple[int, ...]:
    return tuple(tokenizer.encode(" ".join(INSTRUCTIONS), add_special_tokens=False))


def text_prompt(tokenizer: Any, length: int, rng: random.Random) -> list[int]:
    """`length` token ids of the instruction text, from a seeded offset (wrapping around)."""
    corpus = _corpus_ids(tokenizer)
    start = rng.randrange(len(corpus))
    return [corpus[(start + i) % len(corpus)] for i in range(length)]
