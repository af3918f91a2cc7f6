"""PyTorch reference ops over the paged KV cache: the specification, and the CPU path.

Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset; flattening the first two dims indexes slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata, PrefillSpan


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] this step's K
    new_value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] this step's V
    softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap)
    window: int | None = None,  # sliding window: a query at p sees keys at positions > p - window
    layer: int | None = None,  # this call's layer: names its part of each PrefillSpan.mirror
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    Keys and values are gathered block by block through the block table; a sequence with no
    cached context (start_pos == 0) may read this step's K/V directly, the values store_kv wrote.
    A prompt chunk with a mirror appends its K/V there and reads the context in place.
    With a window, prefills gather only the blocks the window reaches (earlier ones may have been
    freed); decodes mask the rest, whose table entries may name blocks now holding other data.
    """
    if softcap or window:
        return _materialised_paged_attention(query, k_cache, v_cache, meta, scale, softcap, window)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if meta.reference is None:
        raise ValueError("the reference backend needs metadata built with reference_views=True")
    views = meta.reference
    if views.decode_rows.numel():
        num_decodes, max_blocks = views.decode_blocks.shape
        flat_blocks = views.decode_blocks.reshape(-1)
        # index_select copies whole blocks: [B * max_blocks, block_size, kv_heads, head_dim]
        k = k_cache.index_select(0, flat_blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        v = v_cache.index_select(0, flat_blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        pure_decode = not views.prefills  # then row i is decode i: no gather or scatter of rows
        q = query if pure_decode else query.index_select(0, views.decode_rows)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, num_heads, 1, head_dim]
            k.transpose(1, 2),  # [B, kv_heads, max_blocks * block_size, head_dim]
            v.transpose(1, 2),
            attn_mask=views.decode_mask,
            scale=scale,
            enable_gqa=True,
        ).squeeze(2)
        if pure_decode:
            return o
        out = torch.empty_like(query)
        out[views.decode_rows] = o
    else:
        out = torch.empty_like(query)
    for span in views.prefills:
        rows = slice(span.query_start, span.query_end)
        q = query[rows].transpose(0, 1)  # [num_heads, q_len, head_dim]
        q_len = q.shape[1]
        mirrored = None  # this chunk's K/V appended to its mirror: the whole context, in place
        if span.mirror is not None:  # (from a long prompt's first chunk on, start_pos 0)
            if layer is None or new_key is None or new_value is None:
                raise ValueError("a mirrored span needs the layer and this step's K/V")
            mirrored = _append_to_mirror(span, span.mirror[layer], new_key[rows], new_value[rows])
        if span.start_pos == 0 and new_key is not None and new_value is not None:
            k, v = new_key[rows].transpose(0, 1), new_value[rows].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            ctx = span.start_pos + q_len
            if mirrored is not None:
                k, v = mirrored
            else:
                k = k_cache.index_select(0, span.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
                v = v_cache.index_select(0, span.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
                k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, ctx, head_dim]
            group = q.shape[0] // k.shape[0]
            o = _grouped_attention(q, k, v, span.causal_mask(group, query.device), scale)
        out[rows] = o.transpose(0, 1)
    return out


def _append_to_mirror(
    span: PrefillSpan,
    mirror: torch.Tensor,  # [2, num_kv_heads, capacity, head_dim] this layer's part
    key: torch.Tensor,  # [q_len, num_kv_heads, head_dim] this step's K of the span
    value: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [num_kv_heads, ctx, head_dim], contiguous rows
    """Write this chunk's K/V after the mirrored context and return the whole context: each KV
    head's positions are contiguous, the layout SDPA reads without a copy."""
    ctx = span.start_pos + key.shape[0]
    mirror[0, :, span.start_pos : ctx] = key.transpose(0, 1)
    mirror[1, :, span.start_pos : ctx] = value.transpose(0, 1)
    return mirror[0, :, :ctx], mirror[1, :, :ctx]


def _materialised_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention with soft-capped scores or a sliding window: SDPA cannot cap, so scores
    are materialised. Every sequence reads its context from the cache (store_kv ran first)."""
    if meta.reference is None:
        raise ValueError("the reference backend needs metadata built with reference_views=True")
    out = torch.empty_like(query)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    views = meta.reference
    if views.mirrored:
        raise ValueError("mirrors serve the plain path only: no soft-capping, no window")
    if views.decode_rows.numel():
        num_decodes = views.decode_blocks.shape[0]
        blocks, mask = views.decode_blocks, views.decode_mask
        if window:
            blocks, mask = _window_blocks(blocks, mask, window, block_size)
        flat_blocks = blocks.reshape(-1)
        k = k_cache.index_select(0, flat_blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        v = v_cache.index_select(0, flat_blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        q = query.index_select(0, views.decode_rows).unsqueeze(2)  # [B, num_heads, 1, head_dim]
        if window:
            # The first gathered block may start before the window, and a block it holds may
            # have been reused for anything, NaN included: a zero weight times NaN is NaN, so the
            # values there are zeroed, not only masked.
            v = v.masked_fill(~mask.view(num_decodes, -1, 1, 1), 0.0)
        o = _capped_attention(q, k.transpose(1, 2), v.transpose(1, 2), mask, scale, softcap)
        out[views.decode_rows] = o.squeeze(2)
    for span in views.prefills:
        rows = slice(span.query_start, span.query_end)
        q = query[rows].transpose(0, 1)  # [num_heads, q_len, head_dim]
        q_len = q.shape[1]
        ctx = span.start_pos + q_len
        # The first query (at start_pos) sees nothing before start_pos - window + 1.
        first_block = max(0, span.start_pos - window + 1) // block_size if window else 0
        first = first_block * block_size
        blocks = span.blocks[first_block:]
        k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[: ctx - first]
        v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[: ctx - first]
        key_pos = torch.arange(first, ctx, device=query.device)
        query_pos = torch.arange(span.start_pos, ctx, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, ctx - first]
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        o = _capped_attention(q, k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap)
        out[rows] = o.transpose(0, 1)
    return out


def _window_blocks(
    blocks: torch.Tensor,  # [B, max_decode_blocks] int64 block ids of each decode, padded
    mask: torch.Tensor,  # [B, 1, 1, max_decode_blocks * block_size] bool, the visible prefix
    window: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, n] block ids, [B, 1, 1, n * block_size] mask
    """Each decode's blocks from the first its window reaches: n = ceil(window / block_size) + 1
    (or fewer) per row instead of the whole table, so a long context costs a window's gather."""
    num_decodes, max_blocks = blocks.shape
    lens = mask.sum(-1).view(num_decodes, 1)  # [B, 1]: the query sits at position len - 1
    first = (lens - window).clamp(min=0) // block_size  # [B, 1] first block the window reaches
    n = min(max_blocks, -(-window // block_size) + 1)
    index = first + torch.arange(n, device=blocks.device)  # [B, n]
    in_table = index < max_blocks  # the window's end passes some shorter rows' tables
    picked = blocks.gather(1, index.clamp(max=max_blocks - 1))
    slot = torch.arange(block_size, device=blocks.device)
    pos = (index[:, :, None] * block_size + slot).view(num_decodes, -1)  # [B, n * block_size]
    visible = (pos < lens) & (pos >= lens - window) & in_table.repeat_interleave(block_size, 1)
    return picked, visible.view(num_decodes, 1, 1, -1)


def _capped_attention(
    q: torch.Tensor,  # [..., num_heads, q_len, head_dim]
    k: torch.Tensor,  # [..., num_kv_heads, ctx, head_dim]
    v: torch.Tensor,  # [..., num_kv_heads, ctx, head_dim]
    mask: torch.Tensor,  # bool, broadcast to [..., num_heads, q_len, ctx]; True where seen
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [..., num_heads, q_len, head_dim]
    """transformers' eager order: scale, cap, mask, fp32 softmax, then P.V. Each KV head's query
    heads are folded into its rows, as in _grouped_attention, so K and V are read per KV head
    instead of being copied to every query head."""
    *lead, num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[-3]
    group = num_heads // num_kv_heads
    # Query head h uses KV head h // group: heads [j*group, (j+1)*group) become KV head j's rows.
    q_rows = q.reshape(*lead, num_kv_heads, group * q_len, head_dim)
    # The mask does not vary by head ([..., 1, q_len, ctx] or [q_len, ctx]): tile it over the
    # group's rows.
    mask_rows = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)
    scores = torch.matmul(q_rows, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask_rows, float("-inf"))
    o = torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)
    return o.reshape(*lead, num_heads, q_len, head_dim)


def _grouped_attention(
    q: torch.Tensor,  # [num_heads, q_len, head_dim]
    k: torch.Tensor,  # [num_kv_heads, ctx, head_dim]
    v: torch.Tensor,  # [num_kv_heads, ctx, head_dim]
    mask: torch.Tensor,  # [group * q_len, ctx] bool, True where a query sees a key
    scale: float,
) -> torch.Tensor:  # [num_heads, q_len, head_dim]
    """Attention with each KV head's query heads folded into its query rows.

    SDPA's `enable_gqa` on a CPU expands K and V to every query head first, a cost that grows with
    the context and not with the chunk: deep in a long prompt it made a step of a few tokens cost
    as much as one of 64. Folding the group into the rows reads each KV head once instead (about
    4x less per layer at 7,800 tokens of context; `benchmarks/long_prompt_fairness.py`).
    """
    num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # Query head h uses KV head h // group, so heads [j*group, (j+1)*group) share KV head j.
    q_rows = q.reshape(1, num_kv_heads, group * q_len, head_dim)
    o = F.scaled_dot_product_attention(q_rows, k[None], v[None], attn_mask=mask, scale=scale)
    return o.view(num_heads, q_len, head_dim)


def copy_blocks(
    cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    pairs: list[tuple[int, int]],  # (src_block, dst_block)
) -> None:
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=cache.device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=cache.device)
    cache[:, :, dst] = cache[:, :, src]


def swap_blocks(
    src_cache: torch.Tensor,  # [num_layers, 2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_layers, 2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    pairs: list[tuple[int, int]],  # (src_block, dst_block)
) -> None:
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=src_cache.device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dst_cache.device)
    dst_cache[:, :, dst] = src_cache[:, :, src].to(dst_cache.device)
