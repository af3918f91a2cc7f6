"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): softmax top-k routing over stacked expert
MLPs, a grouped torch path on the CPU and the Triton fused-MoE kernels on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import KernelOps
from services.executor.models.layers import (
    ACTIVATIONS,
    Attention,
    GatedMLP,
    linear,
    linear_weight,
    make_norm,
)
from services.executor.models.spec import ModelSpec
from services.executor.tensor_parallel import Shard

MOE_QUANTIZATION_REFUSAL = (
    "mixture-of-experts models have no quantized expert kernels; serve them with "
    "--quantization none"
)


def route(
    logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids [.., top_k]
    """Softmax over every expert in fp32, the top_k of it, rescaled to sum to one if asked
    (Mixtral always, Qwen3-MoE by norm_topk_prob), as transformers' routers compute them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [num_experts, 2 * width, hidden]
    down: torch.Tensor,  # [num_experts, hidden, width]
    weights: torch.Tensor,  # [num_tokens, top_k] fp32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    act,
) -> torch.Tensor:  # [num_tokens, hidden]: sum over each token's experts, weighted
    """Tokens sorted by expert, one pair of matmuls per expert that got any, added back in place.

    Every (token, expert) pair is computed once, so the cost follows top_k, not the expert
    count; experts nobody chose cost nothing."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = linear_weight(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = linear_weight(act(gate) * up, down[expert])
        # Weighted in fp32 as transformers' Mixtral does, then back to the activations' dtype.
        y = (y.float() * pair_weights[start : start + count, None]).to(x.dtype)
        out.index_add_(0, rows, y)
        start += count
    return out


class StackedLinear(nn.Module):
    """One bias-free linear per expert, stored as a single [num_experts, out, in] weight."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class ExpertMLPs(nn.Module):
    """Every expert's gated MLP: gate and up fused as in GatedMLP, down apart."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = StackedLinear(num_experts, hidden, 2 * width)
        self.down_proj = StackedLinear(num_experts, width, hidden)


class SparseMoeBlock(nn.Module):
    """Router, then each token's top_k experts; each rank holds a slice of every expert's width
    (as of a dense MLP's) and the partial outputs are summed across ranks."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        moe = spec.moe
        if spec.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {spec.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        self.act_name = spec.hidden_act
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.shard = shard
        # Replicated: every rank routes every token the same way.
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = ExpertMLPs(
            moe.num_experts, spec.hidden_size, moe.intermediate_size // shard.size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = route(linear(x, self.gate), self.top_k, self.renormalize)
        gate_up = self.experts.gate_up_proj.weight
        down = self.experts.down_proj.weight
        if x.is_cuda:
            from kernels.triton_moe import fused_moe

            out = fused_moe(x, gate_up, down, weights, ids, ACTIVATIONS[self.act_name])
        else:
            out = grouped_experts(x, gate_up, down, weights, ids, ACTIVATIONS[self.act_name])
        return self.shard.all_reduce(out)


class SparseMoeDecoderLayer(nn.Module):
    """Pre-norm residual block whose feed-forward is a SparseMoeBlock, or the dense GatedMLP on
    layers the config keeps dense (Qwen3-MoE's mlp_only_layers, decoder_sparse_step)."""

    feed_forward = "mlp"  # the checkpoint's name of the feed-forward module

    def __init__(self, spec: ModelSpec, ops: KernelOps, shard: Shard, sparse: bool = True) -> None:
        super().__init__()
        self.input_layernorm = make_norm(spec, spec.hidden_size)
        self.self_attn = Attention(spec, ops, shard)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size)
        ffn = SparseMoeBlock(spec, shard) if sparse else GatedMLP(spec, shard)
        setattr(self, self.feed_forward, ffn)

    def forward(self, h, cos, sin, kv_cache, meta):  # h: [num_tokens, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + getattr(self, self.feed_forward)(self.post_attention_layernorm(h))
