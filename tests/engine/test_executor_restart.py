"""A new executor in place of a dead one: every request is recomputed from its prompt and emitted
tokens, and greedy and seeded outputs (parallel samples, penalties included) equal an undisturbed
run's."""

from __future__ import annotations

import pytest

from services.engine.llm_engine import LLMEngine, RequestOutput
from services.executor.executor import Executor
from shared.sampling import SamplingParams
from tests.factories import engine_config

SAMPLINGS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, seed=5, frequency_penalty=1.0, min_tokens=4),
    SamplingParams(n=2, best_of=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True),
]


def _texts(outputs: list[RequestOutput]) -> list[list[tuple[list[int], str | None]]]:
    return [[(o.token_ids, o.finish_reason) for o in out.outputs] for out in outputs]


def _run(engine: LLMEngine, prompts, replace_at: int | None, in_flight: bool) -> list:
    ids = [engine.add_request(p, s) for p, s in zip(prompts, SAMPLINGS)]
    done: dict[str, RequestOutput] = {}
    num_steps = 0
    while engine.has_unfinished():
        if num_steps == replace_at:
            if in_flight:
                engine.scheduler.schedule()  # a plan the dead executor never answered
            engine.executor = Executor(engine.config, engine.model_dir)
            engine.scheduler.requeue_all(engine.executor.ready())
            assert engine.scheduler.block_manager.device.num_used == 0
        for update in engine.step():
            if update.finished:
                done[update.group.request_id] = RequestOutput.from_group(update.group)
        num_steps += 1
    return [done[i] for i in ids]


@pytest.mark.parametrize(("replace_at", "in_flight"), [(1, True), (4, False), (7, True)])
def test_outputs_after_an_executor_replacement_equal_an_undisturbed_run(
    tiny_model_dir, prompts, replace_at, in_flight
):
    chosen = prompts[1:6]
    config = engine_config(tiny_model_dir, num_device_blocks=64, max_num_batched_tokens=64)
    expected = _run(LLMEngine(config), chosen, None, False)
    got = _run(LLMEngine(config), chosen, replace_at, in_flight)
    assert _texts(got) == _texts(expected)
