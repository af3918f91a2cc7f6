"""The speculation gate through the in-process engine. The steps' timings are replaced by fixed
costs (10 ms a step, 2 ms a proposal, 5 ms a start), so that the gate decides alike on any
machine: a draft that rarely agrees stops proposing, one that always agrees goes on
speculating, and outputs stay those of plain decoding with the pool left exact and empty."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.speculation_gate import SpeculationGate
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.engine_runs import GREEDY
from tests.support.reference_model import VOCAB
from tests.support.speculation import run_checked

REPETITIVE = [p * 3 for p in random_prompts([4, 9, 17, 30], VOCAB, seed=1)]
LONG_GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.fixture
def fixed_costs(monkeypatch):
    timed = SpeculationGate.step_timed

    def fixed(
        self, num_seqs: int, num_proposed: int, seconds: float, starting: bool = False
    ) -> None:
        # A start costs what 5 ms of a draft's catch-up would.
        timed(
            self, num_seqs, num_proposed, 0.010 + 0.002 * num_proposed + 0.005 * starting, starting
        )

    monkeypatch.setattr(SpeculationGate, "step_timed", fixed)


def _spec(config, adaptive: bool, **spec):
    speculative = SpeculativeConfig(num_tokens=3, max_batch=1000, adaptive=adaptive, **spec)
    return dataclasses.replace(config, speculative=speculative)


def test_a_disagreeing_draft_stops_proposing(fixed_costs, tiny_model_dir, small_draft_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    draft = {"method": "draft", "draft_model": str(small_draft_dir)}
    plain, _ = run_checked(config, REPETITIVE, LONG_GREEDY)
    always, always_engine = run_checked(_spec(config, False, **draft), REPETITIVE, LONG_GREEDY)
    gated, gated_engine = run_checked(_spec(config, True, **draft), REPETITIVE, LONG_GREEDY)
    assert always == plain and gated == plain
    always_spec = always_engine.scheduler.speculation
    gated_spec = gated_engine.scheduler.speculation
    assert always_spec.num_accepted < always_spec.num_proposed / 4  # it does disagree
    assert gated_spec.gate.num_refused > 0
    assert gated_spec.num_proposed < always_spec.num_proposed / 3


def test_a_draft_that_agrees_goes_on_speculating(fixed_costs, tiny_model_dir, prompts, hf_greedy):
    # The target as its own draft: every proposal is accepted, 4 tokens for 16 ms a step.
    config = engine_config(tiny_model_dir, block_size=8)
    draft = {"method": "draft", "draft_model": str(tiny_model_dir)}
    always, always_engine = run_checked(_spec(config, False, **draft), prompts, GREEDY)
    gated, gated_engine = run_checked(_spec(config, True, **draft), prompts, GREEDY)
    assert [o[0] for o in gated] == [o[0] for o in always] == hf_greedy
    always_spec = always_engine.scheduler.speculation
    gated_spec = gated_engine.scheduler.speculation
    assert gated_spec.num_accepted == gated_spec.num_proposed > 0
    # Only the exploring steps (one plain step per batch size met) go without proposals.
    assert gated_spec.num_proposed >= 0.7 * always_spec.num_proposed
