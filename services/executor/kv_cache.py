"""The physical KV pools: one device tensor and one CPU swap tensor, addressed by block id."""

from __future__ import annotations

import torch

from kernels.ops import KernelOps
from services.executor.models.spec import KVLayout
from shared.config import CacheConfig


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        config: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: KernelOps,
    ) -> None:
        self.ops = ops
        self.block_size = config.block_size
        # [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]: one tensor, so
        # copy-on-write and swaps move a block of every layer in one indexing op.
        block_shape = (config.block_size, layout.num_kv_heads, layout.head_dim)
        element_size = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = (
            layout.num_layers * 2 * element_size * block_shape[0] * block_shape[1] * block_shape[2]
        )
        num_device = config.num_device_blocks or config.kv_cache_bytes // self.bytes_per_block
        if num_device < 1:
            raise ValueError(
                f"a KV budget of {config.kv_cache_bytes} bytes holds no block "
                f"({self.bytes_per_block} bytes each)"
            )
        # The swap pool never needs more blocks than the device pool can hand over.
        num_cpu = min(config.swap_space_bytes // self.bytes_per_block, num_device)
        # Zeros, not empty: padded attention reads of unused slots must be finite (0 * NaN = NaN).
        self.device = torch.zeros(
            (layout.num_layers, 2, num_device, *block_shape), dtype=dtype, device=device
        )
        # Pinned when the pool is on a GPU, so swap copies run at DMA speed. They are still
        # synchronous: a plan's swaps complete before its forward pass starts.
        pin = torch.device(device).type == "cuda"
        self.cpu = torch.zeros(
            (layout.num_layers, 2, num_cpu, *block_shape), dtype=dtype, pin_memory=pin
        )

    @property
    def num_device_blocks(self) -> int:
        return self.device.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.shape[2]

    def apply(
        self,
        swap_out: list[tuple[int, int]],  # (device_block, cpu_block)
        swap_in: list[tuple[int, int]],  # (cpu_block, device_block)
        copies: list[tuple[int, int]],  # (src, dst) device blocks
    ) -> None:
        """Block moves of one plan, in the order the scheduler assumed: out, in, copy."""
        self.ops.swap_blocks(self.device, self.cpu, swap_out)
        self.ops.swap_blocks(self.cpu, self.device, swap_in)
        self.ops.copy_blocks(self.device, copies)
