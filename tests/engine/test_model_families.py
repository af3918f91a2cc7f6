"""Every registry family's greedy tokens through the engine equal transformers', token for token:
plain (chunked prefill), block size 1, forced swap, forced recompute and prefix-cache hits."""

from __future__ import annotations

import pytest

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.tiny_families import FAMILIES, VOCAB, hf_greedy, make_tiny_family

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Single tokens, block boundaries and a prompt longer than the 32-token step budget.
LENGTHS = [1, 9, 16, 17, 40, 77]
# Mid-length requests that outgrow 8 blocks of 16 together (each fits alone): preemptions.
CONTENDED = [5, 20, 35, 47, 60, 70, 16, 33]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp(request.param), request.param, seed=7)


def _reference(model_dir, prompts) -> list[list[int]]:
    return [hf_greedy(model_dir, tuple(p), NEW_TOKENS) for p in prompts]


def _run(engine: LLMEngine, prompts) -> list[list[int]]:
    outputs = engine.generate(prompts, GREEDY, on_step=lambda e: e.scheduler.block_manager.check())
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("block_size", [16, 1])
def test_family_greedy_matches_transformers(family_dir, block_size):
    prompts = random_prompts(LENGTHS, VOCAB, seed=11)
    config = engine_config(
        family_dir,
        block_size=block_size,
        num_device_blocks=2048 // block_size,
        max_num_batched_tokens=32,  # the 77-token prompt is prefilled in chunks
    )
    assert _run(LLMEngine(config), prompts) == _reference(family_dir, prompts)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_family_greedy_matches_transformers_under_preemption(family_dir, mode):
    prompts = random_prompts(CONTENDED, VOCAB, seed=12)
    config = engine_config(
        family_dir, block_size=16, num_device_blocks=8, max_num_batched_tokens=64,
        preemption_mode=mode,
    )  # fmt: skip
    engine = LLMEngine(config)
    assert _run(engine, prompts) == _reference(family_dir, prompts)
    assert engine.scheduler.num_preemptions >= 1


def test_family_greedy_matches_transformers_from_the_prefix_cache(family_dir):
    shared = random_prompts([48], VOCAB, seed=13)[0]
    prompts = [shared + tail for tail in random_prompts([3, 10, 21], VOCAB, seed=14)]
    engine = LLMEngine(engine_config(family_dir, block_size=16, enable_prefix_caching=True))
    first = _run(engine, prompts[:1])
    rest = _run(engine, prompts[1:])  # their first three blocks are the first prompt's
    assert engine.scheduler.prefix_cache_hit_tokens >= 2 * 48
    assert first + rest == _reference(family_dir, prompts)
