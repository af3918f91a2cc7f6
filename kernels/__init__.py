"""Paged-attention and KV-cache ops: a PyTorch reference (the spec and the CPU path) and Triton
kernels (GPU, or interpreted for tests), chosen per run by kernels.ops.select_ops."""

from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.ops import KernelOps, select_ops
from kernels.reference import copy_blocks, paged_attention, store_kv, swap_blocks

__all__ = [
    "AttentionMetadata",
    "KernelOps",
    "build_attention_metadata",
    "copy_blocks",
    "paged_attention",
    "select_ops",
    "store_kv",
    "swap_blocks",
]
