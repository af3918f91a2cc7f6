"""Phi-3, Phi-3.5 and Phi-4-mini: a Llama-shaped decoder whose checkpoints store q/k/v and
gate/up already fused, with longrope and partial rotary."""

from __future__ import annotations

from services.executor.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    # The checkpoint's qkv_proj and gate_up_proj load as they are (the packed mapping only
    # matters for checkpoints that store the parts); the tensor-parallel plan splits each
    # part of them. longrope is refused beyond its original context (layers.rope_tables).
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
