"""Phi-3's longrope served beyond its original context gives transformers' greedy tokens:
prompts shorter and longer than it, generations that cross it (recomputed there with the long
factors, as transformers' generate does), chunked prefill, block size 1, preemption by swap
and by recompute, steps planned ahead."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.llm_engine import LLMEngine
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.tiny_families import VOCAB, hf_greedy, make_tiny_family

ORIGINAL = 32  # the shape's original_max_position_embeddings
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Within the original context to the end (5), crossing it while generating (20, 31, 32), and
# longer than it from the prompt on (33, 40, 77; 77 prefilled in chunks).
LENGTHS = [5, 20, 31, 32, 33, 40, 77]
NUM_CROSSING = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    name = "phi3-longrope-beyond"
    return make_tiny_family(tmp_path_factory.mktemp(name), name, seed=7)


@pytest.fixture(scope="module")
def reference(model_dir):
    prompts = random_prompts(LENGTHS, VOCAB, seed=21)
    return prompts, [hf_greedy(model_dir, tuple(p), NEW_TOKENS) for p in prompts]


def test_transformers_switches_factors_within_these_prompts(model_dir, reference):
    # The check below is only worth something if the long factors change greedy tokens here:
    # the same checkpoint with the short factors everywhere must differ somewhere.
    import json

    short_dir = model_dir.parent / "short-only"
    if not short_dir.exists():
        import shutil

        shutil.copytree(model_dir, short_dir)
        config = json.loads((short_dir / "config.json").read_text())
        rope = config["rope_parameters"]
        rope["long_factor"] = rope["short_factor"]
        (short_dir / "config.json").write_text(json.dumps(config))
    prompts, tokens = reference
    assert [hf_greedy(short_dir, tuple(p), NEW_TOKENS) for p in prompts] != tokens


@pytest.mark.parametrize(
    "variant",
    [
        dict(block_size=16),
        dict(block_size=1, num_device_blocks=4096),
        dict(block_size=16, num_device_blocks=9, preemption_mode="swap"),
        dict(block_size=16, num_device_blocks=9, preemption_mode="recompute"),
    ],
    ids=["plain", "block-size-1", "swap", "recompute"],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_longrope_beyond_the_original_context_matches_transformers(
    model_dir, reference, variant, overlap
):
    prompts, tokens = reference
    config = engine_config(model_dir, max_num_batched_tokens=32, **variant)
    engine = LLMEngine(config, overlap_steps=overlap)
    check = lambda e: e.scheduler.block_manager.check()  # noqa: E731
    outputs = engine.generate(prompts, GREEDY, on_step=check)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    # Each crossing sequence was recomputed once with the long factors, no other.
    assert engine.scheduler.num_rope_recomputes == NUM_CROSSING
    # A block's K/V depends on its sequence's length: no prefix cache to share it wrongly.
    assert engine.scheduler.block_manager.prefix_cache is None
    if "preemption_mode" in variant:
        assert engine.scheduler.num_preemptions >= 1


def test_longrope_with_speculation_matches_transformers(model_dir, reference):
    # Speculating sequences still cross the switch once each, recomputed there (a run of
    # proposals never takes short-factor K/V past it: Scheduler._may_outgrow_rope).
    prompts, tokens = reference
    config = engine_config(model_dir, max_num_batched_tokens=64)
    spec = SpeculativeConfig(
        method="ngram", ngram_min=1, num_tokens=3, max_batch=1000, adaptive=False
    )
    engine = LLMEngine(dataclasses.replace(config, speculative=spec))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    assert engine.scheduler.num_rope_recomputes == NUM_CROSSING
    assert engine.scheduler.speculation.num_proposed > 0
