"""Prefix cache in the block pool and manager: chained digests, verified hits, LRU eviction."""

from __future__ import annotations

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.prefix_cache import block_digest


def cached_manager(num_device_blocks: int = 8, **kwargs) -> BlockManager:
    return BlockManager(4, num_device_blocks, 8, enable_prefix_caching=True, **kwargs)


def computed(manager: BlockManager, seq_id: int, token_ids: list[int]) -> list[int]:
    """Sequence seq_id holds these tokens with their K/V written; returns its table."""
    manager.allocate_slots(seq_id, 0, len(token_ids))
    manager.cache_full_blocks(seq_id, token_ids, len(token_ids))
    return list(manager.tables[seq_id])


def refs(manager: BlockManager, block_ids: list[int]) -> list[int]:
    return [manager.device.ref_counts[b] for b in block_ids]


TOKENS = list(range(10, 20))  # two full blocks of 4 and a partial one


def test_digest_chains_through_the_parent():
    first = block_digest(None, [1, 2, 3, 4])
    assert first == block_digest(None, [1, 2, 3, 4])
    assert block_digest(first, [5, 6]) != block_digest(None, [5, 6])
    assert block_digest(first, [5, 6]) != block_digest(block_digest(None, [1, 2, 3, 5]), [5, 6])


def test_freed_full_blocks_stay_findable_and_a_hit_takes_them_back():
    manager = cached_manager()
    assert computed(manager, 0, TOKENS) == [0, 1, 2]
    assert manager.num_cached_blocks == 2  # the partial block is never cached
    manager.free(0)
    assert manager.device.num_free == 8  # cached blocks are free memory
    assert manager.device.evictable_blocks() == [1, 0]  # a sequence's tail is evicted first
    assert manager.cached_prefix(1, TOKENS + [99]) == [0, 1]
    manager.reuse(1, [0, 1])
    assert refs(manager, [0, 1]) == [1, 1]
    assert manager.device.evictable_blocks() == []
    assert manager.device.num_free == 6
    manager.check()


def test_a_lookup_leaves_at_least_one_token_to_compute_and_stops_at_the_first_miss():
    manager = cached_manager()
    computed(manager, 0, TOKENS)
    assert manager.cached_prefix(1, TOKENS[:8]) == [0]  # 8 tokens: the last block is computed
    assert manager.cached_prefix(2, TOKENS[:9]) == [0, 1]
    assert manager.cached_prefix(3, TOKENS[:4] + [0, 0, 0, 0, 1]) == [0]
    assert manager.cached_prefix(4, [99] + TOKENS[1:]) == []  # the chain breaks at block 0
    assert manager.cached_prefix(5, TOKENS[4:8] + TOKENS[4:8] + [1]) == []  # same block, no parent
    # A lookup changes nothing: no reference, no recency.
    assert refs(manager, [0, 1]) == [1, 1]
    manager.check()


def test_blocks_are_found_only_once_their_kv_is_reported_written():
    manager = cached_manager()
    manager.allocate_slots(0, 0, 10)  # planned, not yet reported
    assert manager.cached_prefix(1, TOKENS) == []
    manager.cache_full_blocks(0, TOKENS, 6)  # a first chunk of 6 tokens came back
    assert manager.cached_prefix(1, TOKENS) == [0]
    manager.cache_full_blocks(0, TOKENS, 10)
    assert manager.cached_prefix(1, TOKENS) == [0, 1]


def test_a_forced_digest_collision_never_produces_a_hit():
    # Every block gets the same digest: only a block whose tokens really match may be found.
    manager = cached_manager(digest_fn=lambda parent, token_ids: b"collide")
    computed(manager, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.num_cached_blocks == 1  # the second block's digest was taken by the first
    assert manager.cached_prefix(1, [1, 2, 3, 4, 9, 9, 9, 9, 1]) == [0]
    assert manager.cached_prefix(2, [4, 3, 2, 1, 5, 6, 7, 8, 9]) == []
    manager.check()


def test_a_digest_blind_to_the_parent_cannot_match_a_block_computed_after_other_tokens():
    # The stored parent digest is compared too: equal tokens after a different prefix miss.
    manager = cached_manager(digest_fn=lambda parent, token_ids: bytes(token_ids))
    computed(manager, 0, [1, 1, 1, 1, 3, 3, 3, 3, 5])  # blocks 0 and 1 cached
    table = computed(manager, 1, [2, 2, 2, 2, 3, 3, 3, 3, 6])  # only its first block is new
    assert manager.cached_prefix(2, [2, 2, 2, 2, 3, 3, 3, 3, 7]) == [table[0]]


def test_plain_free_blocks_go_first_then_cached_ones_least_recently_used_first():
    manager = cached_manager(num_device_blocks=6)
    a = TOKENS[:9]
    b = list(range(30, 39))
    assert computed(manager, 0, a) == [0, 1, 2]
    assert computed(manager, 1, b) == [3, 4, 5]
    manager.free(0)
    manager.free(1)
    assert manager.device.evictable_blocks() == [1, 0, 4, 3]
    manager.allocate_slots(2, 0, 12)  # the two plain blocks, then a's tail
    assert manager.tables[2] == [2, 5, 1]
    assert manager.num_cached_blocks == 3
    assert manager.cached_prefix(3, a) == [0]
    assert manager.cached_prefix(4, b) == [3, 4]
    manager.check()


def test_a_hit_makes_blocks_most_recently_used():
    manager = cached_manager(num_device_blocks=6)
    computed(manager, 0, TOKENS[:9])
    computed(manager, 1, list(range(30, 39)))
    manager.free(0)
    manager.free(1)
    manager.reuse(2, manager.cached_prefix(2, TOKENS[:9]))
    manager.free(2)
    assert manager.device.evictable_blocks() == [4, 3, 1, 0]
    manager.allocate_slots(3, 0, 16)  # two plain blocks, then b's blocks
    assert manager.tables[3] == [2, 5, 4, 3]
    assert manager.cached_prefix(4, TOKENS[:9]) == [0, 1]
    manager.check()


def test_a_swapped_out_block_stays_findable_and_swap_in_offers_the_new_copy():
    manager = cached_manager()
    computed(manager, 0, TOKENS[:9])
    assert manager.swap_out([0]) == [(0, 0), (1, 1), (2, 2)]
    assert manager.cached_prefix(1, TOKENS[:9]) == [0, 1]  # the device copy is still there
    manager.allocate_slots(7, 0, 28)  # 7 blocks: the 6 plain ones, then evicts block 1
    manager.free(7)
    assert manager.cached_prefix(1, TOKENS[:9]) == [0]
    manager.swap_in([0])
    table = manager.tables[0]
    manager.cache_full_blocks(0, TOKENS[:9], 9)  # after the step that follows the swap-in
    assert manager.cached_prefix(1, TOKENS[:9]) == [0, table[1]]
    manager.check()


def test_a_fork_shares_cached_blocks_and_keeps_offering_the_childs_own():
    manager = cached_manager()
    computed(manager, 0, TOKENS[:6])
    manager.fork(0, 1)
    child = TOKENS[:6] + [50, 51]
    manager.allocate_slots(1, 6, 2)  # copy-on-write of the shared partial block
    manager.cache_full_blocks(1, child, 8)
    assert manager.cached_prefix(2, child + [1]) == [0, manager.tables[1][1]]
    manager.check()


def test_check_catches_a_cached_block_in_the_plain_free_list():
    manager = cached_manager()
    computed(manager, 0, TOKENS)
    manager.free(0)
    del manager.device._evictable[0]
    manager.device._free.append(0)
    with pytest.raises(AssertionError, match="cached but in the plain queue"):
        manager.check()


def test_check_catches_an_evictable_block_the_cache_forgot():
    manager = cached_manager()
    computed(manager, 0, TOKENS)
    manager.free(0)
    manager.prefix_cache.remove(1)
    with pytest.raises(AssertionError, match="not cached"):
        manager.check()


def test_check_catches_a_digest_that_maps_to_the_wrong_block():
    manager = cached_manager()
    computed(manager, 0, TOKENS)
    digest = next(iter(manager.prefix_cache._block_of))
    manager.prefix_cache._block_of[digest] = 1
    with pytest.raises(AssertionError, match="maps elsewhere"):
        manager.check()


def test_without_prefix_caching_nothing_is_cached():
    manager = BlockManager(4, 8, 8)
    computed(manager, 0, TOKENS)
    manager.free(0)
    assert manager.num_cached_blocks == 0
    assert manager.cached_prefix(1, TOKENS) == []
    assert manager.device.evictable_blocks() == []
    manager.check()
