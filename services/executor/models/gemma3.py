"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layers plus (1 + w) RMSNorm over each q and k
head, and two rotary tables: sliding layers use their own base (rope_local_base_freq), global
layers the global base with the checkpoint's rope scaling."""

from __future__ import annotations

import dataclasses

import torch

from kernels.metadata import AttentionMetadata
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

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        h = self._embed(input_ids)
        # sqrt(hidden) rounded to the activations' dtype, as transformers scales.
        h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        # Each [num_tokens, 1, rotary_dim]: global layers' halves first (rope_tables above).
        global_cos, local_cos = self.cos[positions].to(h.dtype).unsqueeze(1).chunk(2, dim=-1)
        global_sin, local_sin = self.sin[positions].to(h.dtype).unsqueeze(1).chunk(2, dim=-1)
        for i, layer in enumerate(self.layers):
            if self.spec.windows[i] is None:
                h = layer(h, global_cos, global_sin, kv_cache[i], meta)
            else:
                h = layer(h, local_cos, local_sin, kv_cache[i], meta)
        return h
