"""Deep prompt chunks computed in layer parts over several steps give transformers' greedy tokens,
with and without context mirrors, under swap and recompute preemption, and leave nothing held."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.engine.llm_engine import LLMEngine
from services.executor import context_mirror
from services.executor import executor as executor_module
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.engine_runs import CONTENDED_GREEDY, generate_recording_plans, record_plans

# The tiny model's context read is cheap; priced this high, its chunks split from a few dozen
# tokens of context under a cap of 8 (each while the short prompts' streams decode).
READ_ROWS = 40.0


def parted_config(model_dir, parts: bool = True, **kwargs):
    config = engine_config(model_dir, **kwargs)
    scheduler = replace(config.scheduler, max_prefill_tokens_per_request=8, layer_parts=parts)
    return replace(config, scheduler=scheduler)


def layer_parts(plans) -> list:
    return [s for plan in plans for s in plan.seqs if s.layers is not None]


def assert_nothing_held(engine: LLMEngine) -> None:
    device = engine.scheduler.block_manager.device
    assert device.num_free == device.num_blocks
    assert engine.executor.parts.hidden == {}


@pytest.mark.parametrize("mirrors", [True, False])
def test_chunks_in_layer_parts_equal_transformers(
    tiny_model_dir, prompts, hf_greedy, mirrors, monkeypatch
):
    monkeypatch.setattr(executor_module, "CONTEXT_READ_ROWS", READ_ROWS)
    if mirrors:  # the tiny prompts are a few blocks long: mirrored from the second on
        monkeypatch.setattr(context_mirror, "MIN_CONTEXT", 16)
    engine = LLMEngine(parted_config(tiny_model_dir, max_num_batched_tokens=64))
    outputs, plans = generate_recording_plans(engine, prompts)
    assert outputs == hf_greedy
    parts = layer_parts(plans)
    # Chunks went in parts, some of them starting from a later layer.
    assert any(s.layers[0] > 0 for s in parts)
    assert (engine.executor.mirrors.made > 0) == mirrors
    assert_nothing_held(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_layer_parts_under_preemption_equal_transformers(
    tiny_model_dir, contended_prompts, hf_greedy_contended, mode, monkeypatch
):
    monkeypatch.setattr(executor_module, "CONTEXT_READ_ROWS", READ_ROWS)
    monkeypatch.setattr(context_mirror, "MIN_CONTEXT", 16)
    config = parted_config(
        tiny_model_dir, num_device_blocks=12, max_num_batched_tokens=24, preemption_mode=mode
    )
    engine = LLMEngine(config)
    outputs, plans = generate_recording_plans(engine, contended_prompts, CONTENDED_GREEDY)
    assert outputs == hf_greedy_contended
    assert engine.scheduler.num_preemptions >= 1
    assert any(s.layers[0] > 0 for s in layer_parts(plans))
    assert_nothing_held(engine)


def test_seeded_samples_with_layer_parts_equal_those_without(tiny_model_dir, prompts, monkeypatch):
    # n = 2: the second sample forks from the prompt's last part.
    monkeypatch.setattr(executor_module, "CONTEXT_READ_ROWS", READ_ROWS)
    sampling = SamplingParams(n=2, max_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    runs = {}
    for parts in (True, False):
        engine = LLMEngine(parted_config(tiny_model_dir, parts, max_num_batched_tokens=64))
        plans = record_plans(engine)
        results = engine.generate(prompts, sampling)
        assert bool(layer_parts(plans)) == parts
        runs[parts] = [[o.token_ids for o in r.outputs] for r in results]
        assert_nothing_held(engine)
    assert runs[True] == runs[False]


def test_a_prompt_aborted_between_its_parts_leaves_nothing_held(
    tiny_model_dir, prompts, monkeypatch
):
    monkeypatch.setattr(executor_module, "CONTEXT_READ_ROWS", READ_ROWS)
    monkeypatch.setattr(context_mirror, "MIN_CONTEXT", 16)
    engine = LLMEngine(parted_config(tiny_model_dir, max_num_batched_tokens=64))
    stream = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.add_request(prompts[2], stream, request_id="stream")
    engine.step()
    engine.add_request(prompts[-1], SamplingParams(max_tokens=4), request_id="long")
    parts = engine.executor.parts
    while not parts.hidden:  # until a chunk waits between two of its parts
        engine.step()
    engine.abort("long")
    engine.step()  # the next plan tells the executor to forget it
    assert parts.hidden == {} and engine.executor.mirrors.bytes_held() == 0
    engine.abort("stream")
    engine.step()
    assert_nothing_held(engine)
