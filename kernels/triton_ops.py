"""The Triton backend behind the reference signatures: decode or prefill kernel per batch."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.triton_cache import copy_blocks, store_kv, swap_blocks
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import paged_prefill_attention

__all__ = ["copy_blocks", "paged_attention", "store_kv", "swap_blocks"]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    new_key: torch.Tensor | None = None,  # unused: the kernels read this step's K/V from the cache
    new_value: torch.Tensor | None = None,
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    window: int | None = None,  # sliding window: a query at p sees keys at positions > p - window
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if meta.max_query_len <= 1:
        # Every sequence has one query token: the decode kernel (split-K for long contexts).
        return paged_decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            softcap=softcap,
            window=window,
        )
    if meta.mixed is not None:
        return _mixed(query, k_cache, v_cache, meta, scale, softcap, window)
    # Multi-token sequences only (or metadata built without the split): the prefill kernel,
    # which handles one-token rows as well.
    return paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        meta.max_query_len,
        softcap=softcap,
        window=window,
    )


def _mixed(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Decode rows through the decode kernel, the other sequences through the prefill kernel:
    one launch each, their rows gathered and the outputs scattered back."""
    split = meta.mixed
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    out[split.decode_rows] = paged_decode_attention(
        query[split.decode_rows],
        k_cache,
        v_cache,
        meta.block_tables[split.decode_seqs],
        meta.seq_lens[split.decode_seqs],
        scale,
        softcap=softcap,
        window=window,
    )
    out[split.prefill_rows] = paged_prefill_attention(
        query[split.prefill_rows],
        k_cache,
        v_cache,
        meta.block_tables[split.prefill_seqs],
        split.prefill_query_start_loc,
        meta.seq_lens[split.prefill_seqs],
        scale,
        split.prefill_max_query_len,
        softcap=softcap,
        window=window,
    )
    return out
