"""Paged-attention and KV-cache ops. Each op has a PyTorch reference (the spec and the CPU path)."""

from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.reference import copy_blocks, paged_attention, store_kv, swap_blocks

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "copy_blocks",
    "paged_attention",
    "store_kv",
    "swap_blocks",
]
