"""First-fit contiguous allocation over a block pool: a region is a run of consecutive block ids."""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool


class ContiguousAllocator:
    """Finds runs of consecutive free blocks in the pool's own ref counts, so fragmentation is real.

    First fit, lowest block id first: the allocator Orca-style systems put in front of a
    contiguous KV cache. It keeps no state of its own; the pool stays the one owner of ref counts.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def free_runs(self) -> list[tuple[int, int]]:
        """Maximal runs of free blocks as (first block id, num_blocks), by block id."""
        runs: list[tuple[int, int]] = []
        start = None
        for block_id, count in enumerate(self.pool.ref_counts):
            if count == 0 and start is None:
                start = block_id
            elif count != 0 and start is not None:
                runs.append((start, block_id - start))
                start = None
        if start is not None:
            runs.append((start, self.pool.num_blocks - start))
        return runs

    def find(self, num_blocks: int) -> int | None:
        """First block id of the first free run of at least num_blocks, or None."""
        for start, length in self.free_runs():
            if length >= num_blocks:
                return start
        return None

    def allocate(self, num_blocks: int) -> list[int]:
        """Take a region of num_blocks consecutive blocks (callers check find() first)."""
        start = self.find(num_blocks)
        if start is None:
            raise RuntimeError(f"no run of {num_blocks} free blocks (callers must check find)")
        region = list(range(start, start + num_blocks))
        self.pool.take(region)
        return region

    def largest_free_run(self) -> int:
        return max((length for _, length in self.free_runs()), default=0)

    def unusable_free_blocks(self, num_blocks: int) -> int:
        """Free blocks in runs too short for a region of num_blocks: external fragmentation."""
        return sum(length for _, length in self.free_runs() if length < num_blocks)
