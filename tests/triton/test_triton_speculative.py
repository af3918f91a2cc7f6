"""Speculative decoding through the Triton kernels (interpreted on a CPU), against the reference
backend's plain greedy tokens: the K+1 query rows of a speculating sequence take the
prefill-with-context path; a draft model's catch-up rows take that path too and its steps the
decode path, writing its own pool through the target's tables."""

from __future__ import annotations

import dataclasses

from services.bench.layer_skip_draft import make_layer_skip_draft
from services.engine.llm_engine import LLMEngine
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _greedy(model_dir, prompts, backend: str, speculative: SpeculativeConfig | None):
    """(each prompt's greedy tokens, the scheduler's speculation counters)."""
    config = engine_config(model_dir, block_size=8, attention_backend=backend)
    if speculative is not None:
        config = dataclasses.replace(config, speculative=speculative)
    engine = LLMEngine(config)
    outputs = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    return outputs, engine.scheduler.speculation


def test_triton_speculative_greedy_tokens_equal_plain_torch_decoding(tiny_model_dir):
    prompts = [p * 3 for p in random_prompts([5, 9], 384, seed=1)]
    spec = SpeculativeConfig(method="ngram", ngram_min=1, num_tokens=3, max_batch=8, adaptive=False)
    plain, _ = _greedy(tiny_model_dir, prompts, "torch", None)
    verified, speculation = _greedy(tiny_model_dir, prompts, "triton", spec)
    assert verified == plain
    assert speculation.num_proposed > 0


def test_triton_draft_greedy_tokens_equal_plain_torch_decoding(tiny_model_dir, tmp_path):
    draft_dir = make_layer_skip_draft(tiny_model_dir, tmp_path / "draft", [0])
    prompts = random_prompts([5, 19], 384, seed=1)
    spec = SpeculativeConfig(
        method="draft", num_tokens=3, max_batch=8, draft_model=str(draft_dir), adaptive=False
    )
    plain, _ = _greedy(tiny_model_dir, prompts, "torch", None)
    verified, speculation = _greedy(tiny_model_dir, prompts, "triton", spec)
    assert verified == plain
    assert speculation.num_accepted > 0
