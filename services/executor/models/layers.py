"""Layers the decoder families share: RMSNorm variants, rotary tables, gated MLPs, paged attention.

Every layer works on flat batches: [num_tokens, ...] tensors holding prompt chunks and decode
tokens of many sequences, no padding; attention finds each sequence's context through its block
table in the paged KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.metadata import AttentionMetadata
from kernels.ops import KernelOps
from services.executor.models.spec import ModelSpec
from services.executor.quantized import QUANTIZED_LINEARS
from services.executor.tensor_parallel import Shard

# RoPE variants whose frequencies do not depend on the sequence length at run time.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Gate activations of the gated MLP, by their transformers names.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rope_tables(
    config, max_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, rotary_dim] in fp32, computed as transformers computes them.
    layer_type: for configs whose rope_parameters are per layer type (Gemma 3), that type's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' (dynamic NTK scaling) is not supported: its frequencies change "
            "with each sequence's length; serve the checkpoint with rope_type default, linear, "
            "llama3 or yarn"
        )
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported ({', '.join(STATIC_ROPE_TYPES)})"
        )
    if rope_type == "longrope":
        original = longrope_original_len(config)
        # transformers switches to the long factors once a sequence outgrows `original`: a
        # per-sequence choice that one table cannot make (Phi-3 makes it: longrope_tables).
        if max_positions > original:
            raise ValueError(
                f"rope_type 'longrope' is supported up to its original context of {original} "
                f"tokens; set --max-model-len {original} or less (asked for {max_positions})"
            )
    if rope_type == "default":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * (partial or 1.0))
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    return _cos_sin(inv_freq, scaling, max_positions)


def _cos_sin(
    inv_freq: torch.Tensor,  # [rotary_dim // 2]
    scaling: float,
    max_positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # each [max_positions, rotary_dim] fp32
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
    return emb.cos() * scaling, emb.sin() * scaling


def longrope_original_len(config) -> int | None:
    """longrope's original context: sequences longer than this use the long factors. None
    when the config's rope is not longrope."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    return params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", config.max_position_embeddings
    )


def longrope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [2 * max_positions, rotary_dim] fp32: the short factors' rows, then the long
    factors' (both carry longrope's attention factor, as transformers applies it to both)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    compute = ROPE_INIT_FUNCTIONS["longrope"]
    # transformers' own switch: any seq_len beyond the original context picks the long factors.
    short = _cos_sin(*compute(config, "cpu"), max_positions)
    long = _cos_sin(
        *compute(config, "cpu", seq_len=longrope_original_len(config) + 1), max_positions
    )
    return torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32:
            # The same ops in one call (x * rsqrt(mean(x^2) + eps), then times the weight):
            # the same bits, a few dispatches fewer per norm, which count at decode sizes.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # The order transformers uses: the weight multiplies after the cast back.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: weights stored as an offset from one, scaled by (1 + w) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Fp32ScaleRMSNorm(nn.Module):
    """OLMo 2's RMSNorm: scaled by the weight in fp32, then cast back. With a shard, over a
    projection split by heads across ranks: the mean square is the whole projection's."""

    def __init__(self, dim: int, eps: float, shard: Shard | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # this rank's part of the projection
        self.eps = eps
        self.shard = shard or Shard()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        h = x.float()
        if self.shard.size == 1:
            mean_square = h.pow(2).mean(-1, keepdim=True)
        else:
            # Every rank holds an equal width (a replicated KV head counts once per rank that
            # holds it, in the sum and in the width alike).
            total = self.shard.all_reduce(h.pow(2).sum(-1, keepdim=True))
            mean_square = total / (h.shape[-1] * self.shard.size)
        return (self.weight * (h * torch.rsqrt(mean_square + self.eps))).to(x.dtype)


def make_norm(spec: ModelSpec, dim: int) -> nn.Module:
    if spec.norm_offset:
        return OffsetRMSNorm(dim, spec.rms_norm_eps)
    if spec.norm_scale_fp32:
        return Fp32ScaleRMSNorm(dim, spec.rms_norm_eps)
    return RMSNorm(dim, spec.rms_norm_eps)


# Between these row counts MKL runs W @ x^T faster than x @ W^T on this class of CPU (skinny
# activations against wide weights: decode batches; 1.3-2.1x for the wide layers, see
# benchmarks/linear_orientation.py); outside it, x @ W^T is as fast or faster.
FLIPPED_ROWS = (16, 256)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x) for x [num_rows, in_features] -> [num_rows, out_features], fastest orientation."""
    if isinstance(layer, QUANTIZED_LINEARS):  # their kernels take x as it is
        return layer(x)
    return linear_weight(x, layer.weight, layer.bias)


def linear_weight(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    if x.device.type != "cpu" or not FLIPPED_ROWS[0] <= x.shape[0] <= FLIPPED_ROWS[1]:
        return F.linear(x, weight, bias)
    # Made contiguous again: later elementwise ops would keep the column-major layout, and
    # attention kernels fall back to slow paths on it.
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim]
    sin: torch.Tensor,  # [num_tokens, 1, rotary_dim]
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    # Partial rotary (Phi-4-mini): the rest of each head passes through unrotated.
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


class Attention(nn.Module):
    """q/k/v in one fused matmul, rotary, paged attention through KernelOps, o projection."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, shard: Shard) -> None:
        super().__init__()
        self.ops = ops
        self.shard = shard
        # This rank's heads (all of them without tensor parallelism).
        kv_start, kv_end = shard.kv_span(spec.num_heads, spec.num_kv_heads)
        self.num_heads = spec.num_heads // shard.size
        self.num_kv_heads = kv_end - kv_start
        self.head_dim = spec.head_dim
        q_size, kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = make_norm(spec, spec.head_dim)
            self.k_norm = make_norm(spec, spec.head_dim)
        self.qk_norm = spec.qk_norm
        # q and k rotated in one call (rotated_projection) unless a family projects its own way
        # (OLMo 2 norms q and k over whole projections): fixed per class, so decided here.
        self.rotate_together = not spec.qk_norm and type(self).project is Attention.project
        self.scale = spec.softmax_scale
        # Passed only when set, so backends without soft-capping are never asked for it.
        self.extra = {"softcap": spec.attn_softcap} if spec.attn_softcap else {}
        self.layer_index = 0  # set by the model: names this layer's part of a context mirror

    def use_window(self, window: int | None) -> None:
        """This layer attends only to the last `window` positions (None: the whole context)."""
        self.extra.pop("window", None)
        if window:
            self.extra["window"] = window

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, rotary_dim]
        sin: torch.Tensor,  # [num_tokens, 1, rotary_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = x.shape[0]
        if not self.rotate_together or x.device.type != "cpu":
            q, k, v = self.project(x)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            q, k, v = self.rotated_projection(x, cos, sin)
        o = self.attend(q, k, v, kv_cache, meta)
        # Row-parallel: each rank holds some heads' share of the output; the sum is the output.
        return self.shard.all_reduce(linear(o.reshape(num_tokens, -1), self.o_proj))

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim] after rotary
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim] after rotary
        v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        """This step's K/V into the paged cache, then attention over each sequence's context."""
        self.ops.store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        extra = self.extra
        if meta.reference is not None and meta.reference.mirrored:
            extra = {**extra, "layer": self.layer_index}  # the reference path's mirrors only
        return self.ops.paged_attention(
            q, kv_cache[0], kv_cache[1], meta, self.scale, k, v, **extra
        )

    def rotated_projection(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, rotary_dim]
        sin: torch.Tensor,  # [num_tokens, 1, rotary_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """project() then rotary, with q and k rotated in one call: they sit side by side in the
        fused projection's output, and on the CPU each of rotary's seven small ops costs as much
        to dispatch as to run at decode sizes. The same elementwise ops: the same bits."""
        num_tokens = x.shape[0]
        qkv = linear(x, self.qkv_proj)  # [num_tokens, q_size + 2 * kv_size]
        heads, qk_size = self.num_heads + self.num_kv_heads, self.split[0] + self.split[1]
        qk = qkv[:, :qk_size].view(num_tokens, heads, self.head_dim)
        q, k = apply_rotary(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, qk_size:].view(num_tokens, -1, self.head_dim)
        return q, k, v

    def project(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [num_tokens, heads, head_dim], k and v [num_tokens, kv_heads, head_dim], normed
        where the family norms them, before rotary."""
        num_tokens = x.shape[0]
        q, k, v = linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per head
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one fused matmul (SwiGLU, GeGLU)."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        if spec.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {spec.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        self.act = ACTIVATIONS[spec.hidden_act]
        self.shard = shard
        width = spec.intermediate_size // shard.size  # this rank's columns of the MLP
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * width, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(width, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return self.shard.all_reduce(linear(self.act(gate) * up, self.down_proj))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = make_norm(spec, spec.hidden_size)
        self.self_attn = Attention(spec, ops, shard)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size)
        self.mlp = GatedMLP(spec, shard)

    def forward(self, h, cos, sin, kv_cache, meta):  # h: [num_tokens, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))
