"""Load a local Hugging Face checkpoint (config.json + safetensors) into our Llama module."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.ops import KernelOps
from services.executor.llama import LlamaForCausalLM, LlamaSpec, rope_tables
from services.executor.tensor_parallel import Shard, check_divisible

# Checkpoint names that we store fused: (our parameter, shard index) per HF name suffix.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.\w+_proj)\.(weight|bias)$"
)


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    max_positions: int,
    ops: KernelOps,
    device: torch.device | str = "cpu",
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """The model, or with `shard` this rank's slice of it (see tensor_parallel.py)."""
    shard = shard or Shard()
    config = load_hf_config(model_dir)
    spec = LlamaSpec.from_hf_config(config)
    check_divisible(spec, shard.size)
    cos, sin = rope_tables(config, max_positions)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, cos, sin, ops, shard)
    model = model.to_empty(device="cpu").to(dtype)
    model.cos.copy_(cos)  # RoPE tables stay fp32, as transformers computes them
    model.sin.copy_(sin)
    _copy_weights(model, spec, model_dir, shard)
    model.eval()
    return model.to(device)


def _copy_weights(model: LlamaForCausalLM, spec: LlamaSpec, model_dir: Path, shard: Shard) -> None:
    params = dict(model.named_parameters())
    attention = model.layers[0].self_attn
    q_size = attention.num_heads * spec.head_dim
    kv_size = attention.num_kv_heads * spec.head_dim
    width = spec.intermediate_size // shard.size
    shard_sizes = {
        "self_attn.qkv_proj": [q_size, kv_size, kv_size],
        "mlp.gate_up_proj": [width, width],
    }
    filled: Counter[str] = Counter()  # elements written per parameter, to catch missing tensors
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                target, rows = _target(name, shard_sizes)
                if target is None or (target == "lm_head.weight" and spec.tie_word_embeddings):
                    continue
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name} has no place in the model ({target})")
                dest = params[target].data
                if rows is not None:
                    dest = dest[rows[0] : rows[1]]
                tensor = _rank_slice(name, f.get_tensor(name), spec, shard)
                if tensor.shape != dest.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                filled[target] += tensor.numel()
    missing = sorted(p for p, t in params.items() if filled[p] != t.numel())
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} lacks tensors for {missing[:3]} ({len(missing)})"
        )


def _rank_slice(name: str, tensor: torch.Tensor, spec: LlamaSpec, shard: Shard) -> torch.Tensor:
    """The part of checkpoint tensor `name` that this rank holds."""
    if shard.size == 1:
        return tensor
    d = spec.head_dim
    q_start, q_end = shard.span(spec.num_heads)
    kv_start, kv_end = shard.kv_span(spec.num_heads, spec.num_kv_heads)
    i_start, i_end = shard.span(spec.intermediate_size)
    rows = {  # column-parallel: output rows
        "self_attn.q_proj": (q_start * d, q_end * d),
        "self_attn.k_proj": (kv_start * d, kv_end * d),
        "self_attn.v_proj": (kv_start * d, kv_end * d),
        "mlp.gate_proj": (i_start, i_end),
        "mlp.up_proj": (i_start, i_end),
    }
    columns = {  # row-parallel: input columns
        "self_attn.o_proj": (q_start * d, q_end * d),
        "mlp.down_proj": (i_start, i_end),
    }
    match = _LAYER.match(name)
    if match:
        _, module, kind = match.groups()
        if module in rows:
            start, end = rows[module]
            return tensor[start:end]
        if kind == "bias":  # added after the all-reduce's sum: only one rank may add it
            return tensor if shard.is_driver else torch.zeros_like(tensor)
        start, end = columns[module]
        return tensor[:, start:end]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, end = shard.span(spec.vocab_size)
        return tensor[start:end]
    return tensor


def _target(
    name: str, shard_sizes: dict[str, list[int]]
) -> tuple[str | None, tuple[int, int] | None]:
    """Our parameter name (and row range for fused ones) for a checkpoint tensor name."""
    if name.startswith("model."):
        match = _LAYER.match(name)
        if match:
            layer, module, kind = match.groups()
            if module in _FUSED:
                fused, index = _FUSED[module]
                sizes = shard_sizes[fused]
                start = sum(sizes[:index])
                return f"layers.{layer}.{fused}.{kind}", (start, start + sizes[index])
            return f"layers.{layer}.{module}.{kind}", None
        stripped = name[len("model.") :]
        if "rotary_emb" in stripped:
            return None, None
        return stripped, None
    if name == "lm_head.weight":
        return name, None
    return None, None
