"""The decoder-only causal LM every family builds on, with the declarations the executor reads.

A family subclasses DecoderForCausalLM, names its HF architecture and reads its spec from the
transformers config; weights.py (checkpoint names, tensor-parallel slices), the quantizer
(which linears) and the KV pool (layout) read the class attributes below, never a family name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.metadata import AttentionMetadata
from kernels.ops import KernelOps
from services.executor.models.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    linear,
    linear_weight,
    make_norm,
    rope_tables,
)
from services.executor.models.spec import KVLayout, ModelSpec, base_spec_fields
from services.executor.quantized import (
    INT8_ROWS_MAX_ROWS,
    QUANTIZED_LINEARS,
    Int4Linear,
    Int8Linear,
)
from services.executor.tensor_parallel import Shard

# Steps whose sequences compute at most this many tokens each go through the CPU row kernels
# (decodes, verify steps of up to 15 proposals, short prompt chunks): each row attends on its own,
# so a longer chunk's rows would each re-read the whole context where SDPA reads it once.
ROW_QUERY_LIMIT = 16
# rows_forward's placeholder for what a 4-bit linear does not have (column sums, scales).
_NONE = torch.empty(0)


class DecoderForCausalLM(nn.Module):
    # ---- declarations ---------------------------------------------------------------------
    architectures: tuple[str, ...] = ()  # HF `architectures` names this class serves
    model_types: tuple[str, ...] = ()  # config.model_type fallbacks when `architectures` is unset
    # Our fused module -> the checkpoint modules stored in it, in row order (vLLM's
    # packed_modules_mapping). A checkpoint that already stores the fused module loads as is.
    packed_modules_mapping: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # Tensor-parallel split per module of a layer: ("column", parts) splits output rows, each
    # part by its unit; ("row", unit) splits input columns (biases added by one rank only).
    # Units: "q" query heads, "kv" KV heads, "mlp" the MLP width. Unlisted modules (norms) are
    # replicated; embed_tokens and lm_head are split by vocabulary.
    tensor_parallel_plan: dict[str, tuple] = {
        "self_attn.qkv_proj": ("column", ("q", "kv", "kv")),
        "self_attn.o_proj": ("row", "q"),
        "mlp.gate_up_proj": ("column", ("mlp", "mlp")),
        "mlp.down_proj": ("row", "mlp"),
    }
    vocab_parallel = ("embed_tokens", "lm_head")
    # Linears of a layer that quantized CPU kernels may replace (the LM head and embedding too).
    quantizable_modules = (
        "self_attn.qkv_proj",
        "self_attn.o_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
    )
    # Why --quantization int8/int4 cannot run this family (None: they can); the executor
    # refuses with it before quantizing.
    quantization_refusal: str | None = None
    # Checkpoint tensors that hold nothing we load (precomputed rotary frequencies).
    ignored_checkpoint_names = ("rotary_emb",)
    layer_class = DecoderLayer
    row_ops = None  # the CPU row kernels' ops when use_row_kernels took them
    # (the stack's linears, or None where not all are Int8Linear; rows_forward's arguments)
    _row_stack_cache: tuple | None = None

    @classmethod
    def spec_from_config(cls, config, architecture: str) -> ModelSpec:
        """The family's spec; subclasses add or refuse their config's switches."""
        return ModelSpec(**base_spec_fields(config, architecture))

    @classmethod
    def rope_tables(cls, config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_positions, rotary_dim] fp32, the model's `cos`/`sin` buffers; a
        family with several rotary tables lays them side by side in the last dim."""
        return rope_tables(config, max_positions)

    # ---- the model ------------------------------------------------------------------------
    def __init__(
        self,
        spec: ModelSpec,
        cos: torch.Tensor,  # [max_positions, rotary_dim] fp32
        sin: torch.Tensor,  # [max_positions, rotary_dim] fp32
        ops: KernelOps,
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec  # the whole model's numbers; each module knows its own share
        self.shard = shard = shard or Shard()
        self.vocab_start, vocab_end = shard.span(spec.vocab_size)
        local_vocab = vocab_end - self.vocab_start
        self.embed_tokens = nn.Embedding(local_vocab, spec.hidden_size)
        self.layers = nn.ModuleList(
            self.make_layer(spec, ops, shard, index) for index in range(spec.num_layers)
        )
        for index, (layer, window) in enumerate(zip(self.layers, spec.windows, strict=True)):
            layer.self_attn.use_window(window)
            layer.self_attn.layer_index = index
        self.norm = make_norm(spec, spec.hidden_size)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, local_vocab, bias=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def make_layer(self, spec: ModelSpec, ops: KernelOps, shard: Shard, index: int) -> nn.Module:
        """Decoder layer `index`; families whose layers differ by index override it."""
        return self.layer_class(spec, ops, shard)

    @property
    def kv_layout(self) -> KVLayout:
        """This rank's KV pool layout: one block table serves every rank."""
        return self.spec.kv_layout(self.layers[0].self_attn.num_kv_heads)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        layers: tuple[int, int] | None = None,  # only these [first, end); None: all
        hidden: torch.Tensor | None = None,  # [num_tokens, hidden] layer `first`'s input
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        """The decoder layers over this step's tokens; with `layers`, a part of them (a deep
        prompt chunk computed over several steps), from `hidden` when it does not start at 0."""
        first, end = (0, len(self.layers)) if layers is None else layers
        if first == 0:
            h = self._embed(input_ids)
            if self.spec.embed_scale != 1.0:
                # Gemma scales by sqrt(hidden) rounded to the activations' dtype, as transformers.
                h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        elif hidden is None:
            raise ValueError(f"layers from {first} need the hidden states of layer {first - 1}")
        else:
            h = hidden
        rows = positions
        if self.spec.rope_switch_len is not None:
            rows = self._longrope_rows(positions, meta)
        cos = self.cos[rows].to(h.dtype)  # [num_tokens, table width]
        sin = self.sin[rows].to(h.dtype)
        if (
            self.row_ops is not None
            and (first, end) == (0, len(self.layers))
            and meta.token_seqs is not None
            and meta.max_query_len <= ROW_QUERY_LIMIT
            and meta.reference is not None
            and not meta.reference.mirrored
        ):
            return self._forward_rows(h, cos, sin, kv_cache, meta)
        rotary = self.layer_rotary(cos.unsqueeze(1), sin.unsqueeze(1))
        for i in range(first, end):
            h = self.layers[i](h, *rotary[i], kv_cache[i], meta)
        return h

    def use_row_kernels(self, ops) -> bool:
        """Steps of up to ROW_QUERY_LIMIT tokens per sequence run through the CPU row kernels
        (kernels/cpu_rows.py) where this model is built of the layers they implement: Llama's
        decoder layer, RMSNorm, full rotate-half rotary, a SiLU-gated MLP, fp32 on a CPU, no
        soft-capping, window or tensor parallelism. Says whether it does."""
        self.row_ops = ops if ops is not None and self._row_kernels_fit() else None
        self._row_stack_cache = None
        return self.row_ops is not None

    def _row_kernels_fit(self) -> bool:
        spec = self.spec
        if self.shard.size != 1 or spec.rope_switch_len is not None:
            return False
        if self.cos.shape[-1] != spec.head_dim or self.cos.device.type != "cpu":
            return False
        for layer in self.layers:
            if type(layer) is not DecoderLayer:  # (MoE layers have no .mlp, for one)
                return False
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn) is not Attention:
                return False
            if not attn.rotate_together or attn.extra:
                return False
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms):
                return False
            if type(mlp) is not GatedMLP or mlp.act is not F.silu:
                return False
        return True

    def _forward_rows(
        self,
        h: torch.Tensor,  # [num_tokens, hidden] fp32, the embeddings (updated in place)
        cos: torch.Tensor,  # [num_tokens, head_dim] fp32
        sin: torch.Tensor,  # [num_tokens, head_dim] fp32
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        """forward() through the row kernels: per layer the four matmuls in torch and four C++
        calls between them (norm, rotary + KV write + attention, residual + norm, gate)."""
        ops = self.row_ops
        positions, slots = meta.positions.contiguous(), meta.slot_mapping.contiguous()
        h = h.contiguous()
        stack = self._row_stack() if h.shape[0] <= INT8_ROWS_MAX_ROWS else None
        if stack is not None:  # every linear the row kernels' own: the whole loop in C++
            attn = self.layers[0].self_attn
            return ops.rows_forward(
                h, cos, sin, kv_cache, slots, meta.block_tables, meta.token_seqs, positions,
                attn.scale, attn.num_heads, attn.num_kv_heads, *stack,
            )  # fmt: skip
        first = self.layers[0].input_layernorm
        x = ops.rms_norm(h, first.weight, first.eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            o = ops.rows_attention(
                linear(x, attn.qkv_proj), cos, sin, kv_cache[i, 0], kv_cache[i, 1], slots,
                meta.block_tables, meta.token_seqs, positions, attn.scale, attn.num_heads,
                attn.num_kv_heads,
            )  # fmt: skip
            post = layer.post_attention_layernorm
            x = ops.add_rms_norm(h, linear(o, attn.o_proj), post.weight, post.eps)
            mlp_out = linear(ops.silu_mul(linear(x, layer.mlp.gate_up_proj)), layer.mlp.down_proj)
            if i == last:
                h.add_(mlp_out)
            else:
                norm = self.layers[i + 1].input_layernorm
                x = ops.add_rms_norm(h, mlp_out, norm.weight, norm.eps)
        return h

    def _row_stack(self) -> tuple | None:
        """rows_forward's per-layer arguments (norms, eps, and the four linears' packed
        weights, column sums, scales, biases) where every layer's linears are Int8Linear or
        Int4Linear with the row kernels' copy; None otherwise. Which linears the stack has is
        found once; the arguments are rebuilt only when a layer's copy changed."""
        if self._row_stack_cache is None:
            linears = [
                m
                for layer in self.layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
                + (layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ]
            all_rows = all(isinstance(m, (Int8Linear, Int4Linear)) for m in linears)
            self._row_stack_cache = (linears if all_rows else None, None)
        linears, stack = self._row_stack_cache
        if linears is None:
            return None
        if stack is not None and all(m.rows_packed is p for m, p in zip(linears, stack[2])):
            return stack
        if any(m.rows_packed is None for m in linears):
            return None
        norms = [
            n
            for layer in self.layers
            for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        stack = (
            [n.weight for n in norms],
            [float(n.eps) for n in norms],
            [m.rows_packed for m in linears],
            # A 4-bit linear's packed weights carry its scales (rows_forward ignores these).
            [_NONE if isinstance(m, Int4Linear) else m.rows_colsum for m in linears],
            [_NONE if isinstance(m, Int4Linear) else m.scales for m in linears],
            [m.bias for m in linears],
        )
        self._row_stack_cache = (linears, stack)
        return stack

    def layer_rotary(
        self,
        cos: torch.Tensor,  # [num_tokens, 1, table width]: this step's rows of rope_tables
        sin: torch.Tensor,  # [num_tokens, 1, table width]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per layer, each [num_tokens, 1, rotary_dim]
        """Each layer's (cos, sin); one table serves every layer unless a family's
        rope_tables holds several (Gemma 3: global and sliding layers)."""
        return [(cos, sin)] * len(self.layers)

    def _longrope_rows(
        self, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens] int64
        """Each token's row of the longrope tables: the long half when its sequence is longer
        than the switch length, counted as transformers counts it (the whole prompt for its
        prompt tokens, or the whole sequence for a recompute; the token's own position + 1
        for a decode)."""
        lens = positions + 1
        if meta.rope_lens is not None:
            lens = torch.maximum(lens, meta.rope_lens)
        long = lens > self.spec.rope_switch_len
        return positions + long * (self.cos.shape[0] // 2)

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
            return self._softcap(self.lm_head(self.norm(hidden)).float())
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Each rank scores its slice of the vocabulary; every rank gets the whole row.
        logits = self.shard.all_gather_last(linear_weight(self.norm(hidden), weight).float())
        return self._softcap(logits)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] fp32
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
