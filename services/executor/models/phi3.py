"""Phi-3, Phi-3.5 and Phi-4-mini: a Llama-shaped decoder whose checkpoints store q/k/v and
gate/up already fused, with longrope and partial rotary."""

from __future__ import annotations

import dataclasses

import torch

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.layers import longrope_original_len, longrope_tables, rope_tables
from services.executor.models.spec import ModelSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    # The checkpoint's qkv_proj and gate_up_proj load as they are (the packed mapping only
    # matters for checkpoints that store the parts); the tensor-parallel plan splits each
    # part of them.
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        spec = super().spec_from_config(config, architecture)
        return dataclasses.replace(spec, rope_switch_len=longrope_original_len(config))

    @classmethod
    def rope_tables(cls, config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """longrope: [2 * max_positions, rotary_dim], the short factors' rows then the long
        ones' (the forward picks per token by spec.rope_switch_len)."""
        if longrope_original_len(config) is None:
            return rope_tables(config, max_positions)
        return longrope_tables(config, max_positions)
