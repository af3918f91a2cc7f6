"""Qwen2 and Qwen2.5: the Llama decoder with q/k/v biases."""

from __future__ import annotations

import dataclasses

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.spec import ModelSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        spec = super().spec_from_config(config, architecture)
        # Qwen2 has q/k/v biases without saying so in its config; o has none.
        return dataclasses.replace(spec, qkv_bias=True, o_bias=False)
