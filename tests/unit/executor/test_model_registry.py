"""The model registry: which family serves a config, what it refuses, and where checkpoint
tensors go under tensor parallelism (from the packed-module and split declarations)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen3Config

from services.executor.models import model_class, model_spec
from services.executor.models.checkpoint_names import place, rank_slice
from services.executor.models.layers import rope_tables
from services.executor.tensor_parallel import Shard

_SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def test_the_architectures_name_picks_the_family():
    config = Qwen3Config(**_SHAPE, architectures=["Qwen3ForCausalLM"])
    family, name = model_class(config)
    assert (family.__name__, name) == ("Qwen3ForCausalLM", "Qwen3ForCausalLM")
    assert model_spec(config).qk_norm
    # A config built in code names no architecture: its model_type decides.
    assert model_class(LlamaConfig(**_SHAPE))[1] == "LlamaForCausalLM"


def test_an_unknown_architecture_is_refused_by_name():
    config = LlamaConfig(**_SHAPE, architectures=["FancyForCausalLM"])
    with pytest.raises(ValueError, match="architecture FancyForCausalLM is not supported"):
        model_class(config)


def test_dynamic_rope_is_refused_with_a_message():
    params = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    with pytest.raises(ValueError, match="'dynamic' .* is not supported"):
        rope_tables(LlamaConfig(**_SHAPE, rope_parameters=params), 64)


def test_longrope_is_refused_beyond_its_original_context():
    params = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0] * 4,
        long_factor=[4.0] * 4,
        original_max_position_embeddings=32,
    )
    config = Phi3Config(**_SHAPE, original_max_position_embeddings=32, rope_parameters=params)
    assert rope_tables(config, 32)[0].shape == (32, 8)
    with pytest.raises(ValueError, match="--max-model-len 32 or less"):
        rope_tables(config, 64)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fused_checkpoint_tensor_splits_like_its_parts(rank):
    # Phi-3 stores q/k/v in one tensor; Llama stores three. Each rank must end up with the same
    # rows of our fused parameter either way.
    shard = Shard(rank, 2)
    llama, phi3 = model_class(LlamaConfig(**_SHAPE)), model_class(Phi3Config(**_SHAPE))
    spec = llama[0].spec_from_config(LlamaConfig(**_SHAPE), llama[1])
    head_dim = spec.head_dim
    q, k, v = (torch.randn(n * head_dim, 32) for n in (4, 2, 2))
    local = torch.empty((2 + 1 + 1) * head_dim, 32)
    for name, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        placement = place(llama[0], spec, shard, f"model.layers.0.self_attn.{name}.weight")
        assert placement.param == "layers.0.self_attn.qkv_proj.weight"
        start, end = placement.dest_rows
        local[start:end] = rank_slice(placement, tensor, shard)
    fused = place(phi3[0], spec, shard, "model.layers.0.self_attn.qkv_proj.weight")
    assert fused.dest_rows is None
    assert torch.equal(rank_slice(fused, torch.cat([q, k, v]), shard), local)


def test_row_parallel_biases_are_added_by_one_rank():
    spec = model_spec(LlamaConfig(**_SHAPE))
    family, _ = model_class(LlamaConfig(**_SHAPE))
    for rank in (0, 1):
        placement = place(family, spec, Shard(rank, 2), "model.layers.0.self_attn.o_proj.bias")
        got = rank_slice(placement, torch.ones(32), Shard(rank, 2))
        assert torch.equal(got, torch.ones(32) if rank == 0 else torch.zeros(32))


def test_gemma2_declares_alternating_windows_and_serves_its_whole_context():
    from transformers import Gemma2Config

    from services.executor.model_setup import max_model_len

    config = Gemma2Config(**{**_SHAPE, "num_hidden_layers": 4}, head_dim=8, sliding_window=16)
    spec = model_spec(config)
    assert spec.kv_layout().windows == (16, None, 16, None)
    assert (spec.norm_offset, spec.embed_scale) == (1.0, 32**0.5)
    # The kernels mask sliding layers, so the window no longer caps the context.
    limit = config.max_position_embeddings
    assert max_model_len(config, None) == limit
    with pytest.raises(ValueError, match=f"exceeds the model's limit of {limit}"):
        max_model_len(config, limit + 1)


def test_gemma3_declares_its_windows_q_k_norms_and_two_rotary_tables():
    from transformers import Gemma3TextConfig

    from services.executor.models.gemma3 import Gemma3ForCausalLM

    rope = {
        "sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1_000_000.0),
    }
    shape = {**_SHAPE, "num_hidden_layers": 6}
    config = Gemma3TextConfig(**shape, head_dim=8, sliding_window=16, rope_parameters=rope)
    family, _ = model_class(config)  # by model_type gemma3_text
    spec = model_spec(config)
    assert family is Gemma3ForCausalLM
    assert spec.windows == (16,) * 5 + (None,)  # every sixth layer global
    assert spec.qk_norm and spec.norm_offset == 1.0 and spec.shared_window is None
    cos, _ = Gemma3ForCausalLM.rope_tables(config, 32)
    global_cos, local_cos = cos.chunk(2, dim=-1)
    assert torch.equal(global_cos, rope_tables(config, 32, "full_attention")[0])
    assert torch.equal(local_cos, rope_tables(config, 32, "sliding_attention")[0])
    # Position 1's first frequency: 1 rad locally, 1/8 rad under the global linear scaling.
    assert local_cos[1, 0].item() == pytest.approx(torch.cos(torch.tensor(1.0)).item())
    assert global_cos[1, 0].item() == pytest.approx(torch.cos(torch.tensor(1 / 8)).item())
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        model_spec(Gemma3TextConfig(**shape, head_dim=8, use_bidirectional_attention=True))
