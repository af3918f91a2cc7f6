"""Speculative verification rows through the Triton kernels (interpreted on a CPU): the K+1
query rows of a speculating sequence take the prefill-with-context path and give the reference
backend's tokens."""

from __future__ import annotations

import dataclasses

from services.engine.llm_engine import LLMEngine
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts


def test_triton_speculative_greedy_tokens_equal_plain_torch_decoding(tiny_model_dir):
    prompts = [p * 3 for p in random_prompts([5, 9], 384, seed=1)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec = SpeculativeConfig(method="ngram", num_tokens=3, max_batch=8)

    def run(backend: str, speculative: SpeculativeConfig | None):
        config = engine_config(tiny_model_dir, block_size=8, attention_backend=backend)
        if speculative is not None:
            config = dataclasses.replace(config, speculative=speculative)
        engine = LLMEngine(config)
        outputs = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
        return outputs, engine.scheduler.speculation

    plain, _ = run("torch", None)
    verified, speculation = run("triton", spec)
    assert verified == plain
    assert speculation.num_proposed > 0
