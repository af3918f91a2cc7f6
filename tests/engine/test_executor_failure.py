"""A failing forward pass ends the requests of that step with an error instead of hanging them."""

from __future__ import annotations

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config


def test_forward_failure_ends_its_requests_and_frees_their_blocks(tiny_model_dir, prompts):
    engine = LLMEngine(engine_config(tiny_model_dir, num_device_blocks=64))
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.add_request(prompts[2], sampling)
    engine.step()  # the first request is now decoding

    original = engine.executor.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    engine.executor.model.forward = broken
    updates = engine.step()
    assert [(u.group.request_id, u.finished) for u in updates] == [(first, True)]
    assert updates[0].group.seqs[0].finish_reason == "error"
    assert engine.scheduler.block_manager.device.num_free == 64

    engine.executor.model.forward = original  # the engine keeps serving new requests
    [output] = engine.generate([prompts[3]], sampling)
    assert len(output.outputs[0].token_ids) == 6 and output.outputs[0].finish_reason == "length"


def test_failure_on_a_fork_step_ends_the_whole_group_and_forgets_the_children(
    tiny_model_dir, prompts
):
    engine = LLMEngine(engine_config(tiny_model_dir, num_device_blocks=64))
    engine.add_request(prompts[2], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1))

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    original = engine.executor.model.forward
    engine.executor.model.forward = broken
    plan = engine.scheduler.schedule()
    fork_ids = [i for s in plan.seqs for i in s.fork_seq_ids]
    assert len(fork_ids) == 2  # the failing step is the one that would fork the samples
    updates = engine.scheduler.update(engine.executor.execute(plan))
    assert [u.finished for u in updates] == [True]
    engine.executor.model.forward = original
    next_plan = engine.scheduler.schedule()
    assert set(fork_ids) <= set(next_plan.freed_seq_ids)
    assert engine.scheduler.block_manager.device.num_free == 64
