"""Other Llama-family shapes against transformers: tied embeddings, Qwen2's q/k/v biases."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config, make_tiny_llama, make_tiny_tokenizer, random_prompts


def _make_tiny_qwen2(path, vocab_size: int = 384):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=True,
        rope_theta=1000.0,
    )
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.3)
    model.save_pretrained(path)
    make_tiny_tokenizer(vocab_size).save_pretrained(path)
    return path, Qwen2ForCausalLM


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias"])
def test_variant_greedy_matches_transformers(tmp_path, variant):
    if variant == "llama-tied":
        from transformers import LlamaForCausalLM

        model_dir = make_tiny_llama(tmp_path, seed=5, num_kv_heads=4, tie_word_embeddings=True)
        hf_class = LlamaForCausalLM
    else:
        model_dir, hf_class = _make_tiny_qwen2(tmp_path)
    prompts = random_prompts([1, 9, 40, 77], 384, seed=4)
    engine = LLMEngine(engine_config(model_dir, block_size=8, max_num_batched_tokens=32))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    hf = hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                do_sample=False,
                max_new_tokens=12,
                min_new_tokens=12,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == ref[0, len(prompt) :].tolist()
