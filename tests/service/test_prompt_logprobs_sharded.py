"""Prompt logprobs over tensor-parallel ranks (CPU, gloo): every rank runs the LM head over the
asked-for rows, rank 0 reports them, and they equal one rank's."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.llm_engine import LLMEngine
from shared.config import ParallelConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config


def _scores(outputs) -> list[list[float]]:
    return [[t.logprob for t in o.prompt_logprobs.tokens] for o in outputs]


def test_sharded_prompt_logprobs_equal_one_rank(tiny_model_dir, prompts):
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    config = engine_config(tiny_model_dir, max_num_batched_tokens=96)  # chunked prompts too
    expected = LLMEngine(config).generate(prompts, sampling)
    sharded = dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=2))
    with LLMEngine(sharded) as engine:
        got = engine.generate(prompts, sampling)
    for mine, theirs in zip(_scores(got), _scores(expected)):
        assert mine == pytest.approx(theirs, abs=1e-4)
    for mine, theirs in zip(got, expected):
        # A rank may differ only where two logprobs tie within the sharded sum's rounding.
        pairs = zip(mine.prompt_logprobs.ranks, theirs.prompt_logprobs.ranks)
        assert sum(a != b for a, b in pairs) <= len(mine.prompt_token_ids) // 50
        assert [len(t.top_logprobs) for t in mine.prompt_logprobs.tokens] == [2] * (
            len(mine.prompt_token_ids) - 1
        )
