"""Mixtral: the Mistral decoder with a sparse mixture of experts in every layer, top-k routing
renormalised over the chosen experts."""

from __future__ import annotations

import dataclasses

from kernels.ops import KernelOps
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.moe import MOE_QUANTIZATION_REFUSAL, SparseMoeDecoderLayer
from services.executor.models.spec import ModelSpec, MoESpec
from services.executor.tensor_parallel import Shard


class MixtralDecoderLayer(SparseMoeDecoderLayer):
    feed_forward = "block_sparse_moe"


class MixtralForCausalLM(DecoderForCausalLM):
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    # block_sparse_moe.experts.N.{w1,w3,w2} stack into expert N of our fused gate_up and down
    # weights (checkpoint_names strips the expert number); w2 is only renamed.
    packed_modules_mapping = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("w1", "w3"),
        "down_proj": ("w2",),
    }
    # Every expert's width splits across ranks as a dense MLP's does; the router is replicated.
    tensor_parallel_plan = {
        "self_attn.qkv_proj": ("column", ("q", "kv", "kv")),
        "self_attn.o_proj": ("row", "q"),
        "block_sparse_moe.experts.gate_up_proj": ("column", ("moe", "moe")),
        "block_sparse_moe.experts.down_proj": ("row", "moe"),
    }
    # The experts have no quantized kernels: nothing here is quantized, int8/int4 are refused.
    quantizable_modules = ()
    quantization_refusal = MOE_QUANTIZATION_REFUSAL
    layer_class = MixtralDecoderLayer

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        spec = super().spec_from_config(config, architecture)
        moe = MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            sparse_layers=(True,) * config.num_hidden_layers,
        )
        return dataclasses.replace(spec, moe=moe)

    def make_layer(self, spec: ModelSpec, ops: KernelOps, shard: Shard, index: int):
        return self.layer_class(spec, ops, shard, sparse=spec.moe.sparse_layers[index])
