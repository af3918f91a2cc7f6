"""Qwen3 (dense): the Llama decoder with an RMSNorm over each q and k head before rotary."""

from __future__ import annotations

import dataclasses

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.spec import ModelSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        return dataclasses.replace(super().spec_from_config(config, architecture), qk_norm=True)
