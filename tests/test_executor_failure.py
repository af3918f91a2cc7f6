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
