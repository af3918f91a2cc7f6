"""The prompts of the speculative decoding benchmarks: text the output copies from (a passage to
repeat, code to edit) and random token ids (nothing to copy)."""

from __future__ import annotations

import random

from services.executor.smoothing import CALIBRATION_TEXT

NAMES = ("total", "count", "price", "items", "result", "value", "index", "scale", "offset")
CODE = '''def {fn}({a}, {b}):
    """Return the weighted {a} of every entry in {b}."""
    {c} = 0
    for entry in {b}:
        if entry is None:
            continue
        {c} += entry * {a}
    if {c} < 0:
        raise ValueError("negative {c}")
    return {c}


def {fn}_all(groups, {a}):
    return [{fn}({a}, group) for group in groups]
'''


def repeat_prompts(tokenizer, n: int, words: int, seed: int) -> list[list[int]]:
    text = CALIBRATION_TEXT.read_text().split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        start = rng.randrange(0, len(text) - words)
        passage = " ".join(text[start : start + words])
        message = f"Repeat the following text exactly, word for word.\n\n{passage}"
        prompts.append(_chat(tokenizer, message))
    return prompts


def code_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a, b, c, new = rng.sample(NAMES, 4)
        fn = rng.choice(("weigh", "accumulate", "combine", "tally"))
        code = CODE.format(fn=fn, a=a, b=b, c=c)
        message = (
            f"Rename the variable `{c}` to `{new}` in this Python code and return the "
            f"complete code.\n\n```python\n{code}```"
        )
        prompts.append(_chat(tokenizer, message))
    return prompts


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    # Ids from the ordinary part of the vocabulary, as benchmarks/cpu_serving.py.
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 2), min(40000, vocab_size)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def _chat(tokenizer, message: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def workload_prompts(
    workload: str, tokenizer, n: int, seed: int, passage_words: int = 90, random_len: int = 128
) -> list[list[int]]:
    """n prompts of a workload: repeat, code or random."""
    if workload == "repeat":
        return repeat_prompts(tokenizer, n, passage_words, seed)
    if workload == "code":
        return code_prompts(tokenizer, n, seed)
    if workload == "random":
        return random_prompts(len(tokenizer), n, random_len, seed)
    raise ValueError(f"unknown workload {workload!r}: repeat, code or random")
