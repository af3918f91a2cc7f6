"""Run an in-process engine and record what its scheduler planned."""

from __future__ import annotations

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.support.reference_model import CONTENDED_NEW_TOKENS, MAX_NEW_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
# The contended prompts' settings (hf_greedy_contended's length).
CONTENDED_GREEDY = SamplingParams(max_tokens=CONTENDED_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def record_plans(engine: LLMEngine) -> list:
    """The list every plan the engine's scheduler makes from now on is appended to."""
    plans = []
    original_schedule = engine.scheduler.schedule

    def recording_schedule():
        plans.append(original_schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    return plans


def generate_recording_plans(
    engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams = GREEDY
):
    """Each request's first sample's tokens, and every plan the scheduler made on the way
    (the block tables checked after every step)."""
    plans = record_plans(engine)
    outputs = engine.generate(
        prompts, sampling, on_step=lambda e: e.scheduler.block_manager.check()
    )
    return [o.outputs[0].token_ids for o in outputs], plans
