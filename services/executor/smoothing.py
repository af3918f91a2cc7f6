"""SmoothQuant for the int8 path: per-input-channel factors, folded into the weights at load.

A few activation channels are far larger than the rest (after the RMSNorms above all), so one
int8 scale per row leaves the other channels a handful of levels. SmoothQuant (Xiao et al.,
2023) divides channel j of the activations by s_j = max|X_j|^a / max|W_j|^(1-a) and multiplies
the weights' input column j by it: the product is unchanged, the activations get flatter and the
weights take the difference. The division is folded into whatever writes the activations, so it
costs nothing per step: the preceding RMSNorm's weight (qkv, gate/up and the LM head), the v rows
of the qkv projection (o_proj's input is a weighted sum of v) and the up rows of gate/up
(down_proj's input is act(gate) * up). max|X_j| comes from one fp32 pass over a short committed
text (calibration_text.txt: Pride and Prejudice, chapter 20; benchmarks/perplexity.py scores
chapters 1-6).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kernels.metadata import build_attention_metadata
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm
from services.executor.observed_linear import ObservedLinear

CALIBRATION_TEXT = Path(__file__).with_name("calibration_text.txt")
# Maxima over more text are closer to what serving meets: in trials on six chunks of the
# perplexity text, 512 tokens left clearly more loss than 1,024, and 2,048 no less than 1,024.
CALIBRATION_TOKENS = 2048
CALIBRATION_CHUNK = 512
# Migration strength a: 0.6 and 0.7 scored best of 0.4-0.8 on benchmarks/perplexity.py's text
# (0.5, the paper's default, lost about twice as much), with an uneven landscape between them.
ALPHA = 0.6
HEAD = "lm_head"
_BLOCK_SIZE = 16


def input_maxima(
    model: DecoderForCausalLM, token_ids: list[int], names: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """ "layers.{i}.{name}" and "lm_head" -> [in_features] max |x| over fp32 prefills of
    `token_ids` in chunks of CALIBRATION_CHUNK, each from an empty cache as served prompts are."""
    originals: dict[tuple[nn.Module, str], nn.Module] = {}
    observers: dict[str, ObservedLinear] = {}
    for i, layer in enumerate(model.layers):
        for name in names:
            parent_name, child_name = name.split(".")
            parent = getattr(layer, parent_name)
            dense = getattr(parent, child_name)
            originals[parent, child_name] = dense
            observers[f"layers.{i}.{name}"] = ObservedLinear(dense.weight.detach(), dense.bias)
            setattr(parent, child_name, observers[f"layers.{i}.{name}"])
    head_max = torch.zeros(model.spec.hidden_size)  # the final norm's output: the head's input
    try:
        for start in range(0, len(token_ids), CALIBRATION_CHUNK):
            hidden = prefill_hidden(model, token_ids[start : start + CALIBRATION_CHUNK])
            with torch.no_grad():
                torch.maximum(head_max, model.norm(hidden).float().abs().amax(dim=0), out=head_max)
    finally:
        for (parent, child_name), module in originals.items():
            setattr(parent, child_name, module)
    return {name: observer.input_max for name, observer in observers.items()} | {HEAD: head_max}


def head_weight(model: DecoderForCausalLM) -> torch.Tensor:  # [vocab, hidden]
    return (model.embed_tokens if model.lm_head is None else model.lm_head).weight.detach()


def prefill_hidden(model: DecoderForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), hidden] before the final norm: one prefill from a scratch KV cache."""
    layout = model.kv_layout
    num_blocks = -(-len(token_ids) // _BLOCK_SIZE)
    kv_cache = torch.zeros(
        layout.num_layers, 2, num_blocks, _BLOCK_SIZE, layout.num_kv_heads, layout.head_dim
    )
    meta = build_attention_metadata([len(token_ids)], [0], [list(range(num_blocks))], _BLOCK_SIZE)
    with torch.no_grad():
        return model(torch.tensor(token_ids), meta.positions, kv_cache, meta)


def factors(
    input_max: torch.Tensor,  # [in_features] max |x| per channel
    weight_max: torch.Tensor,  # [in_features] max |w| per input channel
    alpha: float,
) -> torch.Tensor:  # [in_features] s: x / s and w * s
    # Floors as the paper's code: a channel calibration never saw active keeps a finite factor.
    return input_max.clamp(min=1e-5).pow(alpha) / weight_max.clamp(min=1e-5).pow(1 - alpha)


def _column_max(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [in]
    return weight.detach().abs().amax(dim=0)


def smoothable(layer: nn.Module) -> bool:
    """A plain pre-norm block, where each folding target feeds only the layer it smooths
    (not Gemma's offset norms or extra norms around the blocks)."""
    return (
        type(layer) is DecoderLayer
        and type(layer.input_layernorm) is RMSNorm
        and type(layer.post_attention_layernorm) is RMSNorm
        and type(layer.self_attn) is Attention
        and type(layer.mlp) is GatedMLP
    )


@torch.no_grad()
def smooth_layers(model: DecoderForCausalLM, maxima: dict[str, torch.Tensor], alpha: float) -> None:
    """In place: every smoothable layer's four linears get their factors, folded upstream; the
    model computes the same function (to fp32 rounding)."""
    for i, layer in enumerate(model.layers):
        if not smoothable(layer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up, down = attn.qkv_proj, mlp.gate_up_proj, mlp.down_proj
        for norm, linear, name in (
            (layer.input_layernorm, qkv, "self_attn.qkv_proj"),
            (layer.post_attention_layernorm, gate_up, "mlp.gate_up_proj"),
        ):
            s = factors(maxima[f"layers.{i}.{name}"], _column_max(linear.weight), alpha)
            norm.weight.div_(s)
            linear.weight.mul_(s)
        _smooth_o_through_v(attn, maxima[f"layers.{i}.self_attn.o_proj"], alpha)
        # down_proj's input is act(gate) * up: dividing up's rows divides it.
        width = down.in_features
        s = factors(maxima[f"layers.{i}.mlp.down_proj"], _column_max(down.weight), alpha)
        gate_up.weight[width:].div_(s[:, None])
        if gate_up.bias is not None:
            gate_up.bias[width:].div_(s)
        down.weight.mul_(s)


def _smooth_o_through_v(attn: Attention, input_max: torch.Tensor, alpha: float) -> None:
    # o_proj's input channel (head h, dim d) is a weighted sum of v's channel (h // group, d),
    # so the query heads that share a KV head share one factor.
    q_size, kv_size, _ = attn.split
    group = attn.num_heads // attn.num_kv_heads
    shape = (attn.num_kv_heads, group, attn.head_dim)
    x_max = input_max.view(shape).amax(dim=1)  # [num_kv_heads, head_dim]
    w_max = _column_max(attn.o_proj.weight).view(shape).amax(dim=1)
    s = factors(x_max, w_max, alpha).flatten()  # [kv_size]
    v_rows = slice(q_size + kv_size, q_size + 2 * kv_size)
    attn.qkv_proj.weight[v_rows].div_(s[:, None])
    if attn.qkv_proj.bias is not None:
        attn.qkv_proj.bias[v_rows].div_(s)
    per_head = s.view(attn.num_kv_heads, 1, attn.head_dim).expand(shape).flatten()
    attn.o_proj.weight.mul_(per_head)


@torch.no_grad()
def smoothed_head(
    model: DecoderForCausalLM, input_max: torch.Tensor, alpha: float
) -> torch.Tensor | None:
    """The LM head's weight [vocab, hidden] times its factors, with the final norm's weight
    divided by them; None (nothing changed) when the final norm is not a plain RMSNorm."""
    if type(model.norm) is not RMSNorm:
        return None
    weight = head_weight(model).float()
    s = factors(input_max, _column_max(weight), alpha)
    model.norm.weight.div_(s)
    return weight * s
