"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layers plus (1 + w) RMSNorm over each q and k
head, and two rotary tables: sliding layers use their own base (rope_local_base_freq), global
layers the global base with the checkpoint's rope scaling."""

from __future__ import annotations

import dataclasses

import torch

from services.executor.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from services.executor.models.layers import rope_tables
from services.executor.models.spec import ModelSpec

# rope_parameters keys of a Gemma 3 config, one rotary table each.
GLOBAL, LOCAL = "full_attention", "sliding_attention"


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    layer_class = Gemma2DecoderLayer

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention (an embedding model) is not supported: "
                "pagedserve serves causal language models"
            )
        spec = super().spec_from_config(config, architecture)
        return dataclasses.replace(spec, qk_norm=True)

    @classmethod
    def rope_tables(cls, config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[max_positions, 2 * rotary_dim]: the global layers' table, then the sliding ones'."""
        global_cos, global_sin = rope_tables(config, max_positions, GLOBAL)
        local_cos, local_sin = rope_tables(config, max_positions, LOCAL)
        return torch.cat((global_cos, local_cos), -1), torch.cat((global_sin, local_sin), -1)

    def layer_rotary(
        self,
        cos: torch.Tensor,  # [num_tokens, 1, 2 * rotary_dim]: global halves first (rope_tables)
        sin: torch.Tensor,  # [num_tokens, 1, 2 * rotary_dim]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        global_cos, local_cos = cos.chunk(2, dim=-1)
        global_sin, local_sin = sin.chunk(2, dim=-1)
        return [
            (global_cos, global_sin) if window is None else (local_cos, local_sin)
            for window in self.spec.windows
        ]
