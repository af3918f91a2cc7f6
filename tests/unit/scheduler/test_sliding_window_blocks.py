"""BlockManager with a sliding window: blocks behind every future query's window are freed as a
sequence advances, its table keeps logical positions, and forks, swaps and the prefix cache
stay consistent (exact block ids and ref counts)."""

from __future__ import annotations

from services.scheduler.block_manager import NULL_BLOCK, BlockManager
from services.scheduler.prefix_cache import block_digest

N = NULL_BLOCK


def make_manager(window: int | None = 6, prefix_caching: bool = False) -> BlockManager:
    # block_size 4: a window of 6 reaches back into at most ceil(6 / 4) + 1 = 3 blocks.
    return BlockManager(4, 8, 8, prefix_caching, block_digest, sliding_window=window)


def test_blocks_wholly_before_the_window_are_freed_as_the_sequence_decodes():
    manager = make_manager()
    manager.allocate_slots(0, 0, 9)  # positions 0..8 in blocks 0, 1, 2
    assert manager.tables[0] == [0, 1, 2]
    # The query at 9 sees positions 4..9: block 0 (0..3) is done with and freed.
    manager.allocate_slots(0, 9, 1)
    assert manager.tables[0] == [N, 1, 2]
    assert manager.device.ref_counts[0] == 0
    manager.allocate_slots(0, 10, 1)  # sees 5..10: block 1 (4..7) is still read
    assert manager.tables[0] == [N, 1, 2]
    manager.allocate_slots(0, 12, 1)  # sees 7..12 in a new block; 4..7 still holds position 7
    assert manager.tables[0] == [N, 1, 2, 3]
    manager.allocate_slots(0, 13, 1)  # sees 8..13
    assert manager.tables[0] == [N, N, 2, 3]
    manager.check()
    assert manager.held_blocks(0) == [2, 3]
    assert manager.num_blocks_of([0]) == 2
    # The executor learns the whole table with freed entries as block 0, never read.
    assert manager.take_table_update(0) == ([0, 0, 2, 3], True)
    manager.free(0)
    manager.check()
    assert manager.device.num_free == 8


def test_without_a_window_every_block_is_kept():
    manager = make_manager(window=None)
    manager.allocate_slots(0, 0, 9)
    manager.allocate_slots(0, 9, 8)
    assert manager.tables[0] == [0, 1, 2, 3, 4]


def test_a_long_prefill_chunk_frees_only_what_its_first_query_cannot_see():
    manager = make_manager()
    manager.allocate_slots(0, 0, 12)
    manager.allocate_slots(0, 12, 8)  # its first query (12) sees 7..12: blocks 0 freed only
    assert manager.tables[0] == [N, 1, 2, 3, 4]
    manager.check()


def test_forked_sequences_release_shared_blocks_behind_the_window_once_each():
    manager = make_manager()
    manager.allocate_slots(0, 0, 9)
    manager.fork(0, 1)
    manager.allocate_slots(0, 9, 1)
    assert manager.tables[0][0] == N and manager.tables[1][0] == 0
    assert manager.device.ref_counts[0] == 1  # the fork still holds it
    manager.allocate_slots(1, 9, 1)
    assert manager.device.ref_counts[0] == 0
    manager.fork(1, 2)  # forking a table with a freed entry shares only its blocks
    assert manager.tables[2][0] == N
    manager.check()


def test_swapping_moves_only_the_blocks_left_in_the_window():
    manager = make_manager()
    manager.allocate_slots(0, 0, 9)
    manager.allocate_slots(0, 9, 4)  # [N, 1, 2, 3]
    pairs = manager.swap_out([0])
    assert pairs == [(1, 0), (2, 1), (3, 2)]
    assert manager.cpu_tables[0] == [N, 0, 1, 2]
    manager.check()
    back = manager.swap_in([0])
    assert [cpu for cpu, _ in back] == [0, 1, 2]
    assert manager.tables[0][0] == N and len(manager.tables[0]) == 4
    manager.check()


def test_cached_blocks_freed_behind_the_window_stay_findable():
    manager = make_manager(prefix_caching=True)
    tokens = list(range(100, 120))
    manager.allocate_slots(0, 0, 9)
    manager.cache_full_blocks(0, tokens, 9)  # blocks 0 and 1 are full and written: cached
    manager.allocate_slots(0, 9, 4)  # block 0 freed: evictable, its K/V intact
    manager.cache_full_blocks(0, tokens, 13)
    manager.check()
    assert manager.device.evictable_blocks() == [0]
    # A new sequence with the same tokens reuses the whole prefix, block 0 included.
    assert manager.cached_prefix(1, tokens[:13]) == [0, 1, 2]


def test_blocks_freed_before_they_were_offered_are_never_cached():
    manager = make_manager(prefix_caching=True)
    tokens = list(range(100, 120))
    manager.allocate_slots(0, 0, 13)
    # Planned before the write of 0..12 was reported (async scheduling): blocks 0 and 1 are
    # freed unoffered, and another sequence may take them before the report comes.
    manager.allocate_slots(0, 14, 1)
    assert manager.tables[0][:2] == [N, N]
    assert manager.device.ref_counts[:2] == [0, 0]
    manager.cache_full_blocks(0, tokens, 13)
    manager.check()
    assert manager.num_cached_blocks == 1  # block 2 only
    assert manager.cached_prefix(2, tokens[:13]) == []  # the chain misses at block 0


def test_blocks_freed_by_a_write_count_back_in_its_need():
    manager = make_manager()
    manager.allocate_slots(0, 0, 12)  # [0, 1, 2]
    # Position 12 takes a new block, and its window (7..12) frees block 0: no net need.
    assert manager.num_new_blocks([(0, 12, 1)]) == 0
    manager.fork(0, 1)  # block 0 is shared now: freeing it returns nothing to the pool
    assert manager.num_new_blocks([(0, 12, 1)]) == 1
    manager.free(1)
    manager.allocate_slots(0, 12, 1)  # [N, 1, 2, 3]
    # Position 16 needs a new block and frees block 1; the freed entry counts for nothing.
    assert manager.num_new_blocks([(0, 16, 1)]) == 0
    assert make_manager(window=None).num_new_blocks([(0, 0, 12)]) == 3


def test_one_writes_freed_blocks_never_pay_for_another_writes_blocks():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)  # position 4 will need a new block and free none
    manager.allocate_slots(1, 0, 16)  # position 14 will need none and free two (0..7)
    assert manager.num_new_blocks([(1, 14, 1)]) == 0
    # Allocated in turn, seq 0 takes its block before seq 1 frees any: 1, not -1 or 0.
    assert manager.num_new_blocks([(0, 4, 1), (1, 14, 1)]) == 1
