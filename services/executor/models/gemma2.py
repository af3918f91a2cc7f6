"""Gemma 2: GeGLU, (1 + w) norms around both sublayers, embeddings scaled by sqrt(hidden),
attention and final logit soft-capping, query_pre_attn_scalar, alternating sliding layers."""

from __future__ import annotations

import dataclasses

from torch import nn

from kernels.ops import KernelOps
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.layers import Attention, GatedMLP, make_norm
from services.executor.models.spec import ModelSpec
from services.executor.tensor_parallel import Shard


class Gemma2DecoderLayer(nn.Module):
    """Sandwich norms: each sublayer's output is normed again before the residual add."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = make_norm(spec, spec.hidden_size)
        self.self_attn = Attention(spec, ops, shard)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size)
        self.pre_feedforward_layernorm = make_norm(spec, spec.hidden_size)
        self.mlp = GatedMLP(spec, shard)
        self.post_feedforward_layernorm = make_norm(spec, spec.hidden_size)

    def forward(self, h, cos, sin, kv_cache, meta):  # h: [num_tokens, hidden]
        attn = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        h = h + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(mlp)


class Gemma2ForCausalLM(DecoderForCausalLM):
    # Sliding layers see only their window; the global layers between them keep every block.
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    layer_class = Gemma2DecoderLayer

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        spec = super().spec_from_config(config, architecture)
        return dataclasses.replace(
            spec,
            hidden_act=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh",
            norm_offset=1.0,
            embed_scale=config.hidden_size**0.5,
            attn_scale=config.query_pre_attn_scalar**-0.5,
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )
