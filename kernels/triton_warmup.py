"""Compile every Triton attention variant a model will meet before its first request.

Triton compiles a kernel per combination of its constexpr values on first use: the prefill
kernel's query tile (BLOCK_Q: 1, 2, 4, ... rows, from each step's longest query), the decode
kernel with and without split-K (and the split merge), per sliding window setting. Met for the
first time mid-serving, each costs a step seconds of compilation; here each is run once on a
one-sequence batch that reads only the pool's block 0 (the kernels write only their outputs).
"""

from __future__ import annotations

import torch

from kernels.launch_math import next_power_of_2
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import (
    _TILE_ROWS,
    largest_query_tile,
    paged_prefill_attention,
    prefill_shape,
)


def prefill_query_tiles(
    num_heads: int, num_kv_heads: int, head_dim: int, tile_rows: int | None = None
) -> list[int]:
    """Every BLOCK_Q paged_prefill_attention can choose for this head layout with tiles of
    tile_rows rows (None: the default, _TILE_ROWS)."""
    group_pad = next_power_of_2(num_heads // num_kv_heads)
    largest = largest_query_tile(tile_rows or _TILE_ROWS, group_pad, head_dim)
    tiles, rows = [], 1
    while rows <= largest:
        tiles.append(rows)
        rows *= 2
    return tiles


def warm_up_attention(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] one layer's K
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] its V
    num_heads: int,
    scale: float,
    softcap: float | None,
    windows: tuple[int | None, ...],  # per layer: each distinct value compiles its variants
) -> list[tuple[str, int, int | None]]:  # (kernel, BLOCK_Q or splits, window) run
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    device, dtype = k_cache.device, k_cache.dtype
    block_size = k_cache.shape[1]
    ran = []
    for window in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
        tile_rows = prefill_shape(device)[0]
        for rows in prefill_query_tiles(num_heads, num_kv_heads, head_dim, tile_rows):
            query = torch.zeros(rows, num_heads, head_dim, dtype=dtype, device=device)
            table = torch.zeros(1, -(-rows // block_size), dtype=torch.int64, device=device)
            starts = torch.tensor([0, rows], dtype=torch.int64, device=device)
            lens = torch.tensor([rows], dtype=torch.int64, device=device)
            paged_prefill_attention(
                query, k_cache, v_cache, table, starts, lens, scale, rows,
                softcap=softcap, window=window,
            )  # fmt: skip
            ran.append(("prefill", rows, window))
        for splits in (1, 2):
            query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
            table = torch.zeros(1, 2, dtype=torch.int64, device=device)
            lens = torch.tensor([2 * block_size], dtype=torch.int64, device=device)
            paged_decode_attention(
                query, k_cache, v_cache, table, lens, scale, num_splits=splits,
                softcap=softcap, window=window,
            )  # fmt: skip
            ran.append(("decode", splits, window))
    return ran
