"""Greedy decoding through the paged engine equals transformers' generate, token for token."""

from __future__ import annotations

import pytest

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.engine_runs import CONTENDED_GREEDY, GREEDY, generate_recording_plans


def _assert_all_blocks_free(engine: LLMEngine) -> None:
    manager = engine.scheduler.block_manager
    manager.check()
    assert manager.device.num_free == manager.device.num_blocks
    assert manager.cpu.num_free == manager.cpu.num_blocks
    assert not manager.tables and not manager.cpu_tables


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
def test_greedy_matches_transformers(tiny_model_dir, prompts, hf_greedy, block_size, chunked):
    # A budget below the longest prompt forces chunked prefill to split it across steps.
    config = engine_config(
        tiny_model_dir,
        block_size=block_size,
        num_device_blocks=4096 // block_size,
        max_num_batched_tokens=96,
        enable_chunked_prefill=chunked,
    )
    engine = LLMEngine(config)
    outputs, plans = generate_recording_plans(engine, prompts, GREEDY)
    assert outputs == hf_greedy
    chunked_steps = [s for p in plans for s in p.seqs if len(s.token_ids) > 1 and not s.sample]
    assert bool(chunked_steps) == chunked  # prompts were split only when chunking is on
    assert max(p.num_tokens for p in plans) <= (96 if chunked else 512)
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_matches_transformers_under_preemption(
    tiny_model_dir, contended_prompts, hf_greedy_contended, mode
):
    # 12 blocks of 16 tokens for 14 requests of up to 140 tokens each: the running groups keep
    # outgrowing the pool and the most recent one is preempted, again and again.
    config = engine_config(
        tiny_model_dir,
        block_size=16,
        num_device_blocks=12,
        max_num_batched_tokens=128,
        preemption_mode=mode,
    )
    engine = LLMEngine(config)
    outputs, plans = generate_recording_plans(engine, contended_prompts, CONTENDED_GREEDY)
    assert outputs == hf_greedy_contended
    assert engine.scheduler.num_preemptions >= 5
    swapped_out = sum(len(p.swap_out) for p in plans)
    swapped_in = sum(len(p.swap_in) for p in plans)
    if mode == "swap":
        assert swapped_out > 0 and swapped_in == swapped_out
    else:
        assert swapped_out == 0 and swapped_in == 0
    _assert_all_blocks_free(engine)


def test_continuous_batching_admits_between_steps(tiny_model_dir, prompts):
    # With room for only four sequences, a waiting request joins as soon as one finishes,
    # while the others are mid-generation: the batch changes at iteration granularity.
    config = engine_config(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=512)
    engine = LLMEngine(config)
    lengths = [4, 30, 8, 16, 5, 12]
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts[:6], lengths)
    ]
    batches = []
    while engine.has_unfinished():
        engine.step()
        batches.append({g.request_id for g in engine.scheduler.running})
    joined_mid_run = [
        i
        for i in range(1, len(batches))
        if batches[i] - batches[i - 1] and batches[i] & batches[i - 1]
    ]
    assert joined_mid_run, "no request joined a batch that was already running"
    assert ids[0] not in batches[5] and ids[4] in batches[5]
