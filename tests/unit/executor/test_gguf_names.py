"""GGUF layer tensors find their place through the family's packed-module declarations."""

from __future__ import annotations

from services.executor.gguf_blocks import GGUF_LAYER_TENSORS, fused_module
from services.executor.models.decoder import DecoderForCausalLM


def test_each_gguf_layer_tensor_lands_in_a_quantizable_module_part():
    packed = DecoderForCausalLM.packed_modules_mapping
    placed = {gguf: fused_module(name, packed) for gguf, name in GGUF_LAYER_TENSORS.items()}
    assert placed == {
        "attn_q": ("self_attn.qkv_proj", 0),
        "attn_k": ("self_attn.qkv_proj", 1),
        "attn_v": ("self_attn.qkv_proj", 2),
        "attn_output": ("self_attn.o_proj", 0),
        "ffn_gate": ("mlp.gate_up_proj", 0),
        "ffn_up": ("mlp.gate_up_proj", 1),
        "ffn_down": ("mlp.down_proj", 0),
    }
    assert {module for module, _ in placed.values()} == set(DecoderForCausalLM.quantizable_modules)


def test_a_family_packing_differently_places_the_same_tensor_elsewhere():
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # gate and up left apart
    assert fused_module("mlp.up_proj", packed) == ("mlp.up_proj", 0)
    assert fused_module("self_attn.v_proj", packed) == ("self_attn.qkv_proj", 2)
