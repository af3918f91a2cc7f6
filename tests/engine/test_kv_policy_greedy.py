"""The allocation policy changes memory, never tokens: greedy outputs match under every one."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.llm_engine import LLMEngine
from services.scheduler.kv_accounting import kv_breakdown
from services.scheduler.kv_policy import KV_POLICIES
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.reference_model import MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("policy", KV_POLICIES)
def test_greedy_outputs_identical_under_every_policy(tiny_model_dir, prompts, hf_greedy, policy):
    # 48 blocks of 16 = 768 slots: orca-max reserves 512 per request, so requests queue for
    # memory under the Orca policies and the pool binds.
    config = engine_config(tiny_model_dir, block_size=16, num_device_blocks=48)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, kv_policy=policy)
    )
    engine = LLMEngine(config)
    peak_running = 0

    def on_step(e: LLMEngine) -> None:
        nonlocal peak_running
        e.scheduler.block_manager.check()
        kv_breakdown(e.scheduler)  # raises if a held block escapes the accounting
        peak_running = max(peak_running, len(e.scheduler.running))

    outputs = engine.generate(prompts, GREEDY, on_step=on_step)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    manager = engine.scheduler.block_manager
    assert manager.device.num_free == manager.device.num_blocks
    # Memory is what differs: orca-max fits one request at a time, paged fits them all.
    expected_peak = {"paged": 12, "orca-max": 1}
    if policy in expected_peak:
        assert peak_running == expected_peak[policy]
