"""Tiny seeded random checkpoints of every registry family, built from transformers' own config
and model classes, with transformers' greedy continuation as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from services.bench.random_models import make_tiny_tokenizer
from tests.support.reference_model import hf_generate

VOCAB = 384
# Shared by every family: GQA (2 KV heads for 4 query heads) and a wide init, so greedy choices
# are not decided by rounding noise.
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_THETA = 10000.0
# name -> (transformers config class, model class, config overrides). Each name is one shape a
# family's checkpoints come in: rope scaling types, tied heads, biases, odd head counts.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-rope-linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=_THETA)),
    ),
    "llama-rope-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
                rope_theta=500000.0,
            )
        ),
    ),
    "llama-rope-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=128,
                rope_theta=_THETA,
            )
        ),
    ),
    # A window shorter than the longer test prompts: masking and block freeing both matter.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Six query heads of 16 (not hidden / heads) over two KV heads.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=6, head_dim=16, tie_word_embeddings=False),
    ),
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    # Phi-4-mini's partial rotary (3/4 of each head) and tied head on Phi-3's fused checkpoint
    # layout.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="default", rope_theta=_THETA, partial_rotary_factor=0.75
            ),
        ),
    ),
    # longrope within its original context: the short factors, as transformers uses there.
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            original_max_position_embeddings=512,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=_THETA,
                short_factor=[1.0, 1.5, 2.0, 3.0, 1.2, 1.1, 4.0, 1.0],
                long_factor=[8.0] * 8,
                original_max_position_embeddings=512,
            ),
        ),
    ),
    # Gemma 2: GeGLU, (1 + w) norms, scaled embeddings, both soft-caps, a query scalar that is
    # not head_dim; every other layer sliding over a window shorter than the longer prompts.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
            sliding_window=20,
        ),
    ),
    # Mixture of experts: more experts than the tokens of a decode step, top-2 renormalised.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2),
    ),
    # Every token of every layer routed to expert 0 alone (see _route_every_token_to_expert_0).
    "mixtral-one-expert": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=1),
    ),
    # Sixteen experts, top-4 without renormalisation, odd head count, the first layer dense.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_attention_heads=6,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3 text: Gemma 2 without soft-capping, plus q/k norms; a sliding layer with its own
    # rotary base and a global one with linear rope scaling.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=20,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=_THETA),
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1_000_000.0),
            },
        ),
    ),
    # OLMo 2: post-norms, q/k RMSNorm over each whole projection; one KV head, so that two
    # ranks each hold it (the k norm's mean square must count it once).
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=1)),
}


# Shapes outside the family matrix (tests of their own).
OTHER_SHAPES = {
    # longrope served beyond a 32-token original context (of 512): prompts and generations
    # cross it; transformers switches to the long factors there and recomputes the cache.
    "phi3-longrope-beyond": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            original_max_position_embeddings=32,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=_THETA,
                short_factor=[1.0, 1.5, 2.0, 3.0, 1.2, 1.1, 4.0, 1.0],
                long_factor=[8.0, 6.0, 4.0, 5.0, 3.0, 7.0, 2.5, 9.0],
                original_max_position_embeddings=32,
            ),
        ),
    ),
}


# Gemma scales embeddings by sqrt(hidden): at this init the residual stream would drown the
# attention output, and soft-capping would not change a single greedy token.
_SMALL_EMBEDDINGS = ("gemma2", "gemma3")


def make_tiny_family(path: Path, name: str, seed: int = 0) -> Path:
    """A seeded random checkpoint of family shape `name` (FAMILIES, OTHER_SHAPES) with the tiny
    tokenizer."""
    import transformers

    config_name, model_name, overrides = {**FAMILIES, **OTHER_SHAPES}[name]
    config = getattr(transformers, config_name)(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # transformers initialises biases and norms plainly; make them matter
        for module_name, param in model.named_parameters():
            if module_name.endswith("bias") or "norm" in module_name:
                param.add_(torch.randn_like(param) * 0.3)
        if name in _SMALL_EMBEDDINGS:
            model.get_input_embeddings().weight.mul_(0.1)
        if name in _ONE_EXPERT:
            _route_every_token_to_expert_0(model)
    model.save_pretrained(path)
    make_tiny_tokenizer(VOCAB).save_pretrained(path)
    return path


_ONE_EXPERT = ("mixtral-one-expert",)
# Two ranks split a model by its family's declarations (packed modules, tensor-parallel plan,
# vocabulary-parallel head, expert widths); rope scaling, a tied head within a family that
# ties elsewhere, and forced routing change nothing about that split, so the two-rank tests
# take one shape per family (a two-rank engine start costs a process: ~10 s of the suite each).
_SAME_SPLIT_AS_THEIR_FAMILY = (
    *_ONE_EXPERT,
    "llama-rope-linear",
    "llama-rope-llama3",
    "llama-rope-yarn",
    "llama-tied",  # qwen2's and qwen3-tied's heads are tied: the tied split is covered there
    "qwen3",  # qwen3-tied runs the same layers with a tied head
    "phi3-longrope",
)
TENSOR_PARALLEL_FAMILIES = tuple(
    name for name in sorted(FAMILIES) if name not in _SAME_SPLIT_AS_THEIR_FAMILY
)
_ROUTED = 0  # the hidden dimension that carries the routing signal


def _route_every_token_to_expert_0(model) -> None:
    """Make expert 0 win every router of a MoE model, for any token: hidden dimension _ROUTED
    is a positive constant in every embedding that no layer writes to, and only expert 0's
    router row reads it, with a weight no other logit comes near."""
    model.get_input_embeddings().weight[:, _ROUTED] = 3.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[_ROUTED] = 0.0
        layer.mlp.experts.down_proj[:, _ROUTED, :] = 0.0  # [experts, hidden, width]
        layer.post_attention_layernorm.weight[_ROUTED] = 1.0
        layer.mlp.gate.weight[:, _ROUTED] = 0.0
        layer.mlp.gate.weight[0, _ROUTED] = 100.0


# transformers' generate(do_sample=False) continuation of a prompt: the families' reference.
hf_greedy = hf_generate
