"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over flat batches and a paged KV cache.

No padding anywhere: the batch is one [num_tokens, ...] tensor holding prompt chunks and decode
tokens of many sequences; attention finds each sequence's context through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.metadata import AttentionMetadata
from kernels.ops import KernelOps
from services.executor.quantized import QUANTIZED_LINEARS
from services.executor.tensor_parallel import Shard

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose frequencies do not depend on the sequence length at run time.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LlamaSpec:
    """The architecture numbers we need, read from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @property
    def context_cost_tokens(self) -> int:
        """Context tokens whose attention (q.k and p.v, every layer) costs one query token the
        multiply-adds of its linear layers and LM head; see ExecutorReady."""
        kv_dim = self.num_kv_heads * self.head_dim
        per_layer = self.hidden_size * (self.num_heads * self.head_dim + 2 * kv_dim)  # q, k, v
        per_layer += self.num_heads * self.head_dim * self.hidden_size  # o
        per_layer += 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        linear = self.num_layers * per_layer + self.hidden_size * self.vocab_size
        attention_per_context_token = 2 * self.num_layers * self.num_heads * self.head_dim
        return max(1, linear // attention_per_context_token)

    @classmethod
    def from_hf_config(cls, config) -> LlamaSpec:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported; "
                f"pagedserve runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            qkv_bias=attention_bias or config.model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


def rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in fp32, computed as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported ({', '.join(STATIC_ROPE_TYPES)})"
        )
    if rope_type == "default":
        heads = config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, dim]
        # Normalise in fp32 and scale after casting back, the order transformers uses.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec, ops: KernelOps, shard: Shard) -> None:
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
        self.scale = spec.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = x.shape[0]
        q, k, v = linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.ops.store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, k, v)
        # Row-parallel: each rank holds some heads' share of the output; the sum is the output.
        return self.shard.all_reduce(linear(o.reshape(num_tokens, -1), self.o_proj))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        width = spec.intermediate_size // shard.size  # this rank's columns of the MLP
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * width, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(width, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return self.shard.all_reduce(linear(F.silu(gate) * up, self.down_proj))


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, ops: KernelOps, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, ops, shard)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, shard)

    def forward(self, h, cos, sin, kv_cache, meta):  # h: [num_tokens, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        spec: LlamaSpec,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: KernelOps,
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec  # the whole model's numbers; each module knows its own share
        self.shard = shard = shard or Shard()
        self.vocab_start, vocab_end = shard.span(spec.vocab_size)
        local_vocab = vocab_end - self.vocab_start
        self.embed_tokens = nn.Embedding(local_vocab, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, ops, shard) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, local_vocab, bias=False)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, head_dim] fp32
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        h = self._embed(input_ids)
        cos = self.cos[positions].to(h.dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].to(h.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], meta)
        return h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [.., hidden]
        if self.shard.size == 1:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank looks up the ids it holds, zeros elsewhere; summed.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        h = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        return self.shard.all_reduce(h * mine[:, None].to(h.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] fp32, only for the rows that sample."""
        if isinstance(self.lm_head, QUANTIZED_LINEARS):  # set by quantize_model; never sharded
            return self.lm_head(self.norm(hidden)).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Each rank scores its slice of the vocabulary; every rank gets the whole row.
        return self.shard.all_gather_last(linear_weight(self.norm(hidden), weight).float())
