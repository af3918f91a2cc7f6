"""Shared fixtures: one tiny seeded model per session and its transformers greedy reference."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

# Tests run tiny models, where intra-op threads only add synchronisation: one thread is several
# times faster, more so when other work shares the cores. Set before torch loads, so that the
# server processes the service tests start inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Without a GPU, Triton kernels can only run interpreted; the variable must be set before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.factories import make_tiny_llama, random_prompts

# Fixtures shared by tiers that live in different folders (the gateway app over a fake backend).
pytest_plugins = ["tests.support.gateway_fixtures"]

VOCAB = 384
# Mixed lengths from 1 to 200: single tokens, block boundaries (16, 32), partial blocks.
PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 150, 200]
MAX_NEW_TOKENS = 24
# Many mid-length requests that all grow together: under a tiny pool they preempt each other.
CONTENDED_LENGTHS = [5, 12, 20, 28, 35, 40, 47, 60, 70, 90, 16, 33, 1, 100]
CONTENDED_NEW_TOKENS = 40


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, VOCAB, seed=1)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir, prompts) -> list[list[int]]:
    """transformers' generate(do_sample=False) continuations: the numerical reference."""
    return [_hf_generate(tiny_model_dir, tuple(p), MAX_NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="session")
def contended_prompts() -> list[list[int]]:
    return random_prompts(CONTENDED_LENGTHS, VOCAB, seed=2)


@pytest.fixture(scope="session")
def hf_greedy_contended(tiny_model_dir, contended_prompts) -> list[list[int]]:
    return [_hf_generate(tiny_model_dir, tuple(p), CONTENDED_NEW_TOKENS) for p in contended_prompts]


@functools.cache
def _hf_model(model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_generate(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    model = _hf_model(model_dir)
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
