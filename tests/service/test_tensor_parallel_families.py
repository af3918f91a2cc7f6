"""Every registry family split over two gloo ranks gives transformers' greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.llm_engine import LLMEngine
from shared.config import ParallelConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.tiny_families import (
    TENSOR_PARALLEL_FAMILIES,
    VOCAB,
    hf_greedy,
    make_tiny_family,
)


@pytest.mark.parametrize("family", TENSOR_PARALLEL_FAMILIES)
def test_family_sharded_over_two_ranks_matches_transformers(tmp_path, family):
    model_dir = make_tiny_family(tmp_path, family, seed=7)
    prompts = random_prompts([1, 17, 40], VOCAB, seed=15)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    config = dataclasses.replace(
        engine_config(model_dir, block_size=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    with LLMEngine(config) as engine:
        outputs = engine.generate(prompts, greedy)
    ours = [o.outputs[0].token_ids for o in outputs]
    assert ours == [hf_greedy(model_dir, tuple(p), 12) for p in prompts]
