"""A pool of physical KV blocks: reference counts and a free list. Every ref change goes here."""

from __future__ import annotations

from collections import Counter, deque


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "device") -> None:
        self.num_blocks = num_blocks
        self.name = name
        self.ref_counts = [0] * num_blocks
        # FIFO reuse keeps block ids predictable in tests and spreads writes over the pool.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"{self.name} block pool exhausted (callers must check num_free)")
        block_id = self._free.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_ids: list[int]) -> None:
        """Allocate these particular free blocks (a contiguous allocator picks its own ids)."""
        wanted = set(block_ids)
        for block_id in wanted:
            if self.ref_counts[block_id] != 0:
                raise RuntimeError(f"{self.name} block {block_id} is not free")
            self.ref_counts[block_id] = 1
        self._free = deque(b for b in self._free if b not in wanted)

    def incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"incref of free {self.name} block {block_id}")
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"decref of free {self.name} block {block_id}")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self._free.append(block_id)

    def check(self, expected: Counter[int]) -> None:
        """Assert ref counts equal `expected` (recounted from tables) and the free list is exact."""
        for block_id in range(self.num_blocks):
            if self.ref_counts[block_id] != expected.get(block_id, 0):
                raise AssertionError(
                    f"{self.name} block {block_id}: ref count {self.ref_counts[block_id]}, "
                    f"tables hold {expected.get(block_id, 0)}"
                )
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError(f"{self.name} free list holds a block twice")
        zero = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        if set(free) != zero:
            raise AssertionError(f"{self.name} free list differs from the unreferenced blocks")
