"""The KV pool sizes of a target and its draft model: one block count for both pools."""

from __future__ import annotations

import dataclasses

import torch

from services.executor.models.spec import KVLayout
from shared.config import CacheConfig


def block_bytes(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of every layer takes in a pool of this layout (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return layout.num_layers * 2 * element_size * block_size * layout.num_kv_heads * layout.head_dim


def shared_pool_configs(
    config: CacheConfig,
    target: KVLayout,
    draft: KVLayout,
    dtype: torch.dtype,
) -> tuple[CacheConfig, CacheConfig]:
    """(target pool, draft pool) cache configs with the same number of device blocks.

    The draft's blocks are the target's blocks: block id b of a sequence's table addresses
    both pools, so the one block manager allocates, frees and copies them together. The
    --kv-cache-gb budget therefore buys blocks of (target + draft) bytes each, and the total
    stays within it; an explicit --num-device-blocks gives both pools that many. The draft
    pool has no swap space: a swapped-out sequence's draft KV is recomputed after swap-in.
    """
    if config.num_device_blocks:
        num_blocks = config.num_device_blocks
    else:
        pair_bytes = block_bytes(target, config.block_size, dtype) + block_bytes(
            draft, config.block_size, dtype
        )
        num_blocks = config.kv_cache_bytes // pair_bytes
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {config.kv_cache_bytes} bytes holds no block of the target "
                f"and draft pools ({pair_bytes} bytes each)"
            )
    target_config = dataclasses.replace(config, num_device_blocks=num_blocks)
    draft_config = dataclasses.replace(config, num_device_blocks=num_blocks, swap_space_bytes=0)
    return target_config, draft_config
