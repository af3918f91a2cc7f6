"""Prompt chunks that read their context from a mirror give transformers' greedy tokens, also
when preemption swaps or recomputes the sequences in between."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.engine.llm_engine import LLMEngine
from services.executor import context_mirror
from tests.factories import engine_config
from tests.support.engine_runs import CONTENDED_GREEDY, generate_recording_plans

MIN_CONTEXT = 16  # the tiny prompts are a few blocks long: mirror from the second block on


def deep_chunks(plans) -> int:
    return sum(
        1
        for plan in plans
        for s in plan.seqs
        if len(s.token_ids) > 1 and not s.num_spec_tokens and s.start_pos >= MIN_CONTEXT
    )


def test_mirrored_chunks_equal_transformers(tiny_model_dir, prompts, hf_greedy, monkeypatch):
    monkeypatch.setattr(context_mirror, "MIN_CONTEXT", MIN_CONTEXT)
    engine = LLMEngine(engine_config(tiny_model_dir, max_num_batched_tokens=24))
    outputs, plans = generate_recording_plans(engine, prompts)
    assert outputs == hf_greedy
    mirrors = engine.executor.mirrors
    # Each long prompt was mirrored from its first chunk on and only appended to: the
    # scheduler tells the executor the prompt's length, so nothing was filled from blocks.
    assert 0 < mirrors.made < deep_chunks(plans)
    assert mirrors.fills == 0
    assert mirrors.bytes_held() == 0  # every prompt finished: nothing kept


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_mirrored_chunks_under_preemption_equal_transformers(
    tiny_model_dir, contended_prompts, hf_greedy_contended, mode, monkeypatch
):
    monkeypatch.setattr(context_mirror, "MIN_CONTEXT", MIN_CONTEXT)
    config = engine_config(
        tiny_model_dir,
        num_device_blocks=12,
        max_num_batched_tokens=24,
        preemption_mode=mode,
    )
    engine = LLMEngine(config)
    outputs, plans = generate_recording_plans(engine, contended_prompts, CONTENDED_GREEDY)
    assert outputs == hf_greedy_contended
    assert engine.scheduler.num_preemptions >= 1
    assert engine.executor.mirrors.fills > 0


def test_no_mirror_budget_means_no_mirrors(tiny_model_dir):
    config = engine_config(tiny_model_dir)
    config = replace(config, cache=replace(config.cache, context_mirror_bytes=0))
    assert LLMEngine(config).executor.mirrors is None
