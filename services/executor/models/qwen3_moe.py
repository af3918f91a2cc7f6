"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) with experts in the layers its config makes sparse,
top-k routing renormalised only when norm_topk_prob is set."""

from __future__ import annotations

import dataclasses

from kernels.ops import KernelOps
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.moe import MOE_QUANTIZATION_REFUSAL, SparseMoeDecoderLayer
from services.executor.models.spec import ModelSpec, MoESpec
from services.executor.tensor_parallel import Shard


def sparse_layers(config) -> tuple[bool, ...]:
    """Which layers hold experts, by transformers' Qwen3MoeDecoderLayer rule."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in dense and config.num_experts > 0 and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    # mlp.experts.N.{gate,up,down}_proj stack into expert N of mlp.experts' fused weights
    # through the default packed mapping; dense layers keep mlp.gate_up_proj and down_proj.
    tensor_parallel_plan = {
        **DecoderForCausalLM.tensor_parallel_plan,
        "mlp.experts.gate_up_proj": ("column", ("moe", "moe")),
        "mlp.experts.down_proj": ("row", "moe"),
    }
    # The experts have no quantized kernels: nothing here is quantized, int8/int4 are refused.
    quantizable_modules = ()
    quantization_refusal = MOE_QUANTIZATION_REFUSAL
    layer_class = SparseMoeDecoderLayer

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        spec = super().spec_from_config(config, architecture)
        moe = MoESpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            sparse_layers=sparse_layers(config),
        )
        return dataclasses.replace(spec, qk_norm=True, moe=moe)

    def make_layer(self, spec: ModelSpec, ops: KernelOps, shard: Shard, index: int):
        return self.layer_class(spec, ops, shard, sparse=spec.moe.sparse_layers[index])
