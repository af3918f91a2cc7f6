"""The embedded SmolLM2-135M-Instruct (a LlamaForCausalLM) through the model registry, unquantized,
gives transformers' greedy tokens: a real checkpoint behind the Llama family's tiny-model tests."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.llm_engine import LLMEngine
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.tiny_families import hf_greedy


@pytest.mark.slow
def test_embedded_model_greedy_matches_transformers():
    model_dir = resolve_model(None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Paged attention stores"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    config = engine_config(model_dir, block_size=16)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, quantization="none")
    )
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in LLMEngine(config).generate(prompts, greedy)]
    assert ours == [hf_greedy(model_dir, tuple(p), 12) for p in prompts]
