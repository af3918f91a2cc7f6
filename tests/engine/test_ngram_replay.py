"""The offline n-gram replay counts what the engine does: on the tiny model's greedy outputs it
proposes and accepts exactly as many tokens as the scheduler's own counters say."""

from __future__ import annotations

import dataclasses

import pytest

from services.bench.ngram_replay import ReplayCounts, replay_stream
from services.engine.llm_engine import LLMEngine
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.reference_model import VOCAB

# Prompts that repeat themselves and runs long enough that the random model's greedy output
# falls into loops, so that proposals are both accepted and rejected.
REPETITIVE = [p * 3 for p in random_prompts([4, 9, 17, 30], VOCAB, seed=1)]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("k", "n_min", "n_max"), [(3, 1, 4), (5, 1, 2)])
def test_replay_counts_equal_the_engines_counters(tiny_model_dir, k, n_min, n_max):
    spec = SpeculativeConfig(
        method="ngram", num_tokens=k, ngram_min=n_min, ngram_max=n_max, adaptive=False
    )
    config = dataclasses.replace(engine_config(tiny_model_dir, block_size=8), speculative=spec)
    replayed = ReplayCounts()
    with LLMEngine(config) as engine:
        for prompt in REPETITIVE:  # one at a time: every step has room for K proposals
            (out,) = engine.generate([prompt], GREEDY)
            replayed.add(replay_stream(spec, prompt, list(out.outputs[0].token_ids)))
        counters = engine.scheduler.speculation
        assert replayed.num_accepted > 0 and replayed.num_proposed > replayed.num_accepted
        assert (replayed.num_proposed, replayed.num_accepted) == (
            counters.num_proposed,
            counters.num_accepted,
        )
