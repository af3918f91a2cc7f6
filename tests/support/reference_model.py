"""The tiny model's test sizes and transformers' greedy continuations: the numerical reference
that the engine's greedy tests compare against."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

VOCAB = 384
# Mixed lengths from 1 to 200: single tokens, block boundaries (16, 32), partial blocks.
PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 150, 200]
MAX_NEW_TOKENS = 24
# Many mid-length requests that all grow together: under a tiny pool they preempt each other.
CONTENDED_LENGTHS = [5, 12, 20, 28, 35, 40, 47, 60, 70, 90, 16, 33, 1, 100]
CONTENDED_NEW_TOKENS = 40


@functools.cache
def hf_model(model_dir: Path):
    """transformers' own model of the checkpoint's architecture (any registered family)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_generate(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
