"""A draft model through the Triton kernels (interpreted on a CPU): its catch-up rows take the
prefill-with-context path and its steps the decode path, writing its own pool through the
target's tables; the verified tokens are the reference backend's plain greedy tokens."""

from __future__ import annotations

import dataclasses

from services.bench.layer_skip_draft import make_layer_skip_draft
from services.engine.llm_engine import LLMEngine
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts


def test_triton_draft_greedy_tokens_equal_plain_torch_decoding(tiny_model_dir, tmp_path):
    draft_dir = make_layer_skip_draft(tiny_model_dir, tmp_path / "draft", [0])
    prompts = random_prompts([5, 19], 384, seed=1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec = SpeculativeConfig(method="draft", num_tokens=3, max_batch=8, draft_model=str(draft_dir))

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
    assert speculation.num_accepted > 0
