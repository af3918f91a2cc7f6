"""A pool of physical KV blocks: reference counts and free lists. Every ref change goes here."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

from services.scheduler.prefix_cache import PrefixCache


class BlockPool:
    """Unreferenced blocks wait in one of two queues: `_free` holds nothing reusable (FIFO reuse
    keeps block ids predictable in tests and spreads writes over the pool); `_evictable` holds
    blocks the prefix cache can still hand out, least recently used first. Allocation takes from
    `_free` first and evicts only when it is empty, so a cached prefix lives as long as it can.
    Both count as free: a cached block costs nothing until someone needs the memory.
    """

    def __init__(
        self, num_blocks: int, name: str = "device", cache: PrefixCache | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.name = name
        self.cache = cache
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def evictable_blocks(self) -> list[int]:
        """Free blocks still holding a cached prefix, least recently used first."""
        return list(self._evictable)

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self.cache.remove(block_id)  # evicted: its content is about to be overwritten
        else:
            raise RuntimeError(f"{self.name} block pool exhausted (callers must check num_free)")
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_ids: list[int]) -> None:
        """Allocate these particular free blocks (a contiguous allocator picks its own ids)."""
        wanted = set(block_ids)
        for block_id in wanted:
            if self.ref_counts[block_id] != 0:
                raise RuntimeError(f"{self.name} block {block_id} is not free")
            self.ref_counts[block_id] = 1
            if block_id in self._evictable:  # evicted for the region
                del self._evictable[block_id]
                self.cache.remove(block_id)
        self._free = deque(b for b in self._free if b not in wanted)

    def reuse(self, block_id: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit), free or not."""
        if self.ref_counts[block_id] == 0:
            del self._evictable[block_id]  # KeyError: a free block that holds nothing cached
        self.ref_counts[block_id] += 1

    def incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"incref of free {self.name} block {block_id}")
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        self.release([block_id])

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (a sequence's table, in logical order).

        Cached blocks that become free join the LRU queue last block first, so that of one
        sequence's blocks the tail is evicted before the prefix others are likelier to share.
        """
        newly_evictable = []
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"decref of free {self.name} block {block_id}")
            self.ref_counts[block_id] = count - 1
            if count > 1:
                continue
            if self.cache is not None and block_id in self.cache:
                newly_evictable.append(block_id)
            else:
                self._free.append(block_id)
        for block_id in reversed(newly_evictable):
            self._evictable[block_id] = None

    def check(self, expected: Counter[int]) -> None:
        """Assert ref counts equal `expected` (recounted from tables), the free queues hold exactly
        the unreferenced blocks, and only cached blocks wait in the evictable one."""
        for block_id in range(self.num_blocks):
            if self.ref_counts[block_id] != expected.get(block_id, 0):
                raise AssertionError(
                    f"{self.name} block {block_id}: ref count {self.ref_counts[block_id]}, "
                    f"tables hold {expected.get(block_id, 0)}"
                )
        free = list(self._free) + list(self._evictable)
        if len(set(free)) != len(free):
            raise AssertionError(f"{self.name} free queues hold a block twice")
        zero = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        if set(free) != zero:
            raise AssertionError(f"{self.name} free list differs from the unreferenced blocks")
        if self.cache is None:
            if self._evictable:
                raise AssertionError(f"{self.name} pool without a cache has evictable blocks")
            return
        self.cache.check()
        stray = [b for b in self._evictable if b not in self.cache]
        if stray:
            raise AssertionError(f"{self.name} evictable blocks {stray} are not cached")
        stale = [b for b in self._free if b in self.cache]
        if stale:
            raise AssertionError(f"{self.name} blocks {stale} are cached but in the plain queue")
