"""Raw quantized blocks of a GGUF file (Q4_1, Q8_0), named after our parameters, for repacking.

Repacking the file's own blocks keeps its exact weights; quantizing the dequantized fp32 copy
again would round them a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32  # values per Q4_1 / Q8_0 block

# GGUF tensor name within a layer (llama.cpp's naming) -> the checkpoint module it holds; the
# model's packed_modules_mapping then says which of our (fused) modules, and which part of it.
GGUF_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def fused_module(
    checkpoint_module: str, packed_modules_mapping: dict[str, tuple[str, ...]]
) -> tuple[str, int]:
    """("self_attn.k_proj", {"qkv_proj": ("q_proj", "k_proj", "v_proj")}) ->
    ("self_attn.qkv_proj", 1): our module and the index of its part; unpacked modules keep
    their name, part 0."""
    parent, leaf = checkpoint_module.rsplit(".", 1)
    for fused, parts in packed_modules_mapping.items():
        if leaf in parts:
            return f"{parent}.{fused}", parts.index(leaf)
    return checkpoint_module, 0


@dataclass
class Q4_1:
    """w = d * q + m per block of 32 inputs."""

    q: torch.Tensor  # [rows, cols] int32 in [0, 15]
    d: torch.Tensor  # [rows, cols // 32] fp32
    m: torch.Tensor  # [rows, cols // 32] fp32

    def dequantized(self) -> torch.Tensor:  # [rows, cols] fp32, as gguf.dequantize computes it
        rows, cols = self.q.shape
        groups = self.q.view(rows, -1, BLOCK).float() * self.d[..., None] + self.m[..., None]
        return groups.view(rows, cols)


@dataclass
class Q8_0:
    """w = d * q per block of 32 values."""

    q: torch.Tensor  # [rows, cols] int8
    d: torch.Tensor  # [rows, cols // 32] fp32


def read_q4_1(raw: np.ndarray) -> Q4_1:
    """raw: [rows, blocks * 20] uint8; each block is d (fp16), m (fp16), 16 bytes of nibbles."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    # ggml's order: the low nibbles are values 0..15 of the block, the high nibbles 16..31.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int32)
    return Q4_1(torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(d), torch.from_numpy(m))


def read_q8_0(raw: np.ndarray) -> Q8_0:
    """raw: [rows, blocks * 34] uint8; each block is d (fp16) and 32 int8 values."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)
    return Q8_0(torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(d))


def _unpermute_rows(rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers undoes it the same way
    when it loads a GGUF); whole rows move, so the blocks within a row are untouched."""
    half = rows // num_heads // 2
    index = np.arange(rows).reshape(num_heads, half, 2)
    return index.swapaxes(2, 1).reshape(rows)


def read_blocks(
    gguf_path: Path,
    num_heads: int,
    num_kv_heads: int,
    packed_modules_mapping: dict[str, tuple[str, ...]],
) -> dict[str, list]:
    """Our parameter name -> the parts of its (fused) weight in order, each Q4_1 or Q8_0;
    only tensors stored in those two types are returned. `packed_modules_mapping`: the model
    family's (models/decoder.py), which fuses the checkpoint's modules."""
    from gguf import GGMLQuantizationType, GGUFReader

    readers = {GGMLQuantizationType.Q4_1: read_q4_1, GGMLQuantizationType.Q8_0: read_q8_0}
    parts: dict[str, dict[int, Q4_1 | Q8_0]] = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        if tensor.tensor_type not in readers:
            continue
        name = tensor.name.removesuffix(".weight")
        if name == "token_embd":
            parts.setdefault("embed_tokens", {})[0] = readers[tensor.tensor_type](tensor.data)
            continue
        fields = name.split(".")
        if len(fields) != 3 or fields[0] != "blk" or fields[2] not in GGUF_LAYER_TENSORS:
            continue
        module, index = fused_module(GGUF_LAYER_TENSORS[fields[2]], packed_modules_mapping)
        raw = np.asarray(tensor.data)
        if fields[2] in ("attn_q", "attn_k"):
            heads = num_heads if fields[2] == "attn_q" else num_kv_heads
            raw = raw[_unpermute_rows(raw.shape[0], heads)]
        parts.setdefault(f"layers.{fields[1]}.{module}", {})[index] = readers[tensor.tensor_type](
            raw
        )
    return {name: [p[i] for i in sorted(p)] for name, p in parts.items()}
