"""OLMo 2 (Olmo2ForCausalLM): the Llama decoder with norms after each sublayer instead of
before it, and one RMSNorm over each whole q and k projection (all heads together)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kernels.ops import KernelOps
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.layers import Attention, Fp32ScaleRMSNorm, GatedMLP, linear, make_norm
from services.executor.models.spec import ModelSpec
from services.executor.tensor_parallel import Shard


class Olmo2Attention(Attention):
    def __init__(self, spec: ModelSpec, ops: KernelOps, shard: Shard) -> None:
        super().__init__(spec, ops, shard)
        q_size, kv_size, _ = self.split  # this rank's heads: the norms' weights split with them
        self.q_norm = Fp32ScaleRMSNorm(q_size, spec.rms_norm_eps, shard)
        self.k_norm = Fp32ScaleRMSNorm(kv_size, spec.rms_norm_eps, shard)

    def project(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = x.shape[0]
        q, k, v = linear(x, self.qkv_proj).split(self.split, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # over the whole projection, before the heads
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )


class Olmo2DecoderLayer(nn.Module):
    """Post-norm residual block: h + norm(attn(h)), then h + norm(mlp(h))."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, shard: Shard) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(spec, ops, shard)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size)
        self.mlp = GatedMLP(spec, shard)
        self.post_feedforward_layernorm = make_norm(spec, spec.hidden_size)

    def forward(self, h, cos, sin, kv_cache, meta):  # h: [num_tokens, hidden]
        h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2ForCausalLM(DecoderForCausalLM):
    architectures = ("Olmo2ForCausalLM",)
    model_types = ("olmo2",)
    layer_class = Olmo2DecoderLayer
    # The q and k norms' weights hold one entry per row of their projection: split by heads.
    tensor_parallel_plan = {
        **DecoderForCausalLM.tensor_parallel_plan,
        "self_attn.q_norm": ("column", ("q",)),
        "self_attn.k_norm": ("column", ("kv",)),
    }

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        spec = super().spec_from_config(config, architecture)
        return dataclasses.replace(spec, norm_scale_fp32=True)
