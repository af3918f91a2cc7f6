"""BlockPool and BlockManager: exact block ids, ref counts, copy-on-write and swap pairs."""

from __future__ import annotations

from collections import Counter

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.block_pool import BlockPool


def make_manager(
    block_size: int = 4, num_device_blocks: int = 8, num_cpu_blocks: int = 8
) -> BlockManager:
    return BlockManager(block_size, num_device_blocks, num_cpu_blocks)


def make_shared(manager: BlockManager, num_tokens: int, num_forks: int) -> list[int]:
    """Sequence 0 holds `num_tokens` tokens; sequences 1..num_forks are forked from it."""
    manager.allocate_slots(0, 0, num_tokens)
    for child in range(1, num_forks + 1):
        manager.fork(0, child)
    return list(manager.tables[0])


def refs(pool: BlockPool, block_ids: list[int]) -> list[int]:
    return [pool.ref_counts[b] for b in block_ids]


def assert_all_free(manager: BlockManager) -> None:
    manager.check()
    assert manager.tables == {} and manager.cpu_tables == {}
    assert manager.device.num_free == manager.device.num_blocks
    assert manager.cpu.num_free == manager.cpu.num_blocks


# ---- BlockPool ------------------------------------------------------------------------------


def test_pool_allocates_ids_in_fifo_order():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.ref_counts == [1, 1, 1, 1]
    assert (pool.num_free, pool.num_used) == (0, 4)


def test_pool_reuses_freed_blocks_in_free_order():
    pool = BlockPool(4)
    for _ in range(4):
        pool.allocate()
    pool.decref(2)
    pool.decref(0)
    pool.decref(3)
    assert [pool.allocate() for _ in range(3)] == [2, 0, 3]


def test_pool_frees_a_block_only_when_its_last_reference_goes():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.incref(block)
    pool.incref(block)
    assert pool.ref_counts[block] == 3
    pool.decref(block)
    pool.decref(block)
    assert (pool.ref_counts[block], pool.num_free) == (1, 1)
    pool.decref(block)
    assert (pool.ref_counts[block], pool.num_free) == (0, 2)
    assert pool.allocate() == 1  # the never-used block is still ahead of the freed one
    assert pool.allocate() == 0


def test_pool_rejects_exhaustion_and_refs_to_free_blocks():
    pool = BlockPool(1, "device")
    pool.allocate()
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()
    pool.decref(0)
    with pytest.raises(RuntimeError, match="decref of free"):
        pool.decref(0)
    with pytest.raises(RuntimeError, match="incref of free"):
        pool.incref(0)


def test_pool_check_compares_ref_counts_with_expected():
    pool = BlockPool(3)
    pool.allocate()
    pool.allocate()
    pool.incref(1)
    pool.check(Counter({0: 1, 1: 2}))
    with pytest.raises(AssertionError, match="block 1"):
        pool.check(Counter({0: 1, 1: 1}))
    with pytest.raises(AssertionError, match="block 2"):
        pool.check(Counter({0: 1, 1: 2, 2: 1}))


# ---- allocate on demand ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "table"),
    [(1, [0]), (3, [0]), (4, [0]), (5, [0, 1]), (8, [0, 1]), (9, [0, 1, 2])],
)
def test_allocate_slots_takes_just_enough_blocks(num_tokens, table):
    manager = make_manager(block_size=4)
    assert manager.num_new_blocks([(0, 0, num_tokens)]) == len(table)
    manager.allocate_slots(0, 0, num_tokens)
    assert manager.tables[0] == table
    assert manager.device.num_free == 8 - len(table)
    manager.check()


def test_a_block_is_added_only_when_the_last_one_is_full():
    manager = make_manager(block_size=4)
    manager.allocate_slots(0, 0, 3)
    assert manager.tables[0] == [0]
    manager.allocate_slots(0, 3, 1)  # fills block 0 exactly
    assert manager.tables[0] == [0]
    assert manager.num_new_blocks([(0, 4, 1)]) == 1
    manager.allocate_slots(0, 4, 1)
    assert manager.tables[0] == [0, 1]
    assert manager.num_new_blocks([(0, 5, 3)]) == 0
    manager.allocate_slots(0, 5, 3)
    assert manager.tables[0] == [0, 1]
    assert manager.num_new_blocks([(0, 8, 5)]) == 2
    manager.allocate_slots(0, 8, 5)
    assert manager.tables[0] == [0, 1, 2, 3]
    assert manager.take_copies() == []
    manager.check()


def test_interleaved_sequences_take_ids_from_one_fifo_list():
    manager = make_manager(block_size=2)
    manager.allocate_slots(0, 0, 2)
    manager.allocate_slots(1, 0, 3)
    manager.allocate_slots(0, 2, 1)
    manager.allocate_slots(2, 0, 1)
    assert manager.tables == {0: [0, 3], 1: [1, 2], 2: [4]}
    manager.check()


def test_freed_blocks_are_reused_in_free_order():
    manager = make_manager(block_size=4, num_device_blocks=4)
    manager.allocate_slots(0, 0, 8)  # [0, 1]
    manager.allocate_slots(1, 0, 4)  # [2]
    manager.free(1)
    manager.free(0)
    # Free list now: 3 (never used), then 2, then 0 and 1 in table order.
    manager.allocate_slots(2, 0, 16)
    assert manager.tables[2] == [3, 2, 0, 1]
    manager.check()


def test_num_new_blocks_sums_over_writes():
    manager = make_manager(block_size=4)
    manager.allocate_slots(0, 0, 6)  # [0, 1], 2 slots left in block 1
    writes = [(0, 6, 2), (1, 0, 9), (2, 0, 1)]  # 0 + 3 + 1
    assert manager.num_new_blocks(writes) == 4
    for write in writes:
        manager.allocate_slots(*write)
    assert manager.device.num_free == 8 - 2 - 4


# ---- fork and copy-on-write -----------------------------------------------------------------


@pytest.mark.parametrize("num_forks", [1, 2, 3])
def test_fork_shares_every_block(num_forks):
    manager = make_manager(block_size=4)
    parent = make_shared(manager, 10, num_forks)
    assert parent == [0, 1, 2]
    for child in range(1, num_forks + 1):
        assert manager.tables[child] == [0, 1, 2]
        assert manager.tables[child] is not manager.tables[0]
    assert refs(manager.device, parent) == [num_forks + 1] * 3
    assert manager.device.num_free == 5  # forking allocates nothing
    manager.check()


def test_copy_on_write_of_a_shared_partial_last_block():
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=1)  # both hold [0, 1]; block 1 has 2 of 4 slots used
    manager.allocate_slots(0, 6, 1)
    assert manager.tables == {0: [0, 2], 1: [0, 1]}
    assert manager.take_copies() == [(1, 2)]
    assert manager.take_copies() == []  # taken once
    assert refs(manager.device, [0, 1, 2]) == [2, 1, 1]
    # The last owner of block 1 now writes in place: no new block, no copy.
    assert manager.num_new_blocks([(1, 6, 1)]) == 0
    manager.allocate_slots(1, 6, 1)
    assert manager.tables == {0: [0, 2], 1: [0, 1]}
    assert manager.take_copies() == []
    assert manager.device.num_free == 5
    manager.check()


def test_copy_on_write_plus_new_blocks_in_one_write():
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=1)
    assert manager.num_new_blocks([(0, 6, 7)]) == 3  # copy block 1, then blocks 2 and 3
    manager.allocate_slots(0, 6, 7)
    assert manager.tables == {0: [0, 2, 3, 4], 1: [0, 1]}
    assert manager.take_copies() == [(1, 2)]
    assert refs(manager.device, [0, 1, 2, 3, 4]) == [2, 1, 1, 1, 1]
    manager.check()


def test_appending_after_a_full_shared_block_copies_nothing():
    manager = make_manager(block_size=4)
    make_shared(manager, 8, num_forks=2)  # [0, 1] both full, ref 3
    writes = [(0, 8, 1), (1, 8, 1), (2, 8, 1)]
    assert manager.num_new_blocks(writes) == 3
    for write in writes:
        manager.allocate_slots(*write)
    assert manager.tables == {0: [0, 1, 2], 1: [0, 1, 3], 2: [0, 1, 4]}
    assert manager.take_copies() == []
    assert refs(manager.device, [0, 1]) == [3, 3]
    manager.check()


@pytest.mark.parametrize(
    ("writers", "expected"),
    [
        ([0], 1),  # w=1 < r=3: one copy
        ([0, 1], 2),  # w=2 < r=3: two copies, the third owner keeps the original
        ([0, 1, 2], 2),  # w=r=3: the last writer is sole owner by then and writes in place
        ([2, 0, 1], 2),  # order does not change the count
    ],
)
def test_num_new_blocks_counts_writers_of_a_shared_block(writers, expected):
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=2)  # [0, 1] with ref 3; block 1 partial
    writes = [(seq_id, 6, 1) for seq_id in writers]
    assert manager.num_new_blocks(writes) == expected
    free_before = manager.device.num_free
    for write in writes:
        manager.allocate_slots(*write)
    assert free_before - manager.device.num_free == expected
    assert len(manager.take_copies()) == expected
    manager.check()


def test_copy_on_write_with_three_writers_exact_ids():
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=2)
    for seq_id in (0, 1, 2):
        manager.allocate_slots(seq_id, 6, 1)
    assert manager.tables == {0: [0, 2], 1: [0, 3], 2: [0, 1]}
    assert manager.take_copies() == [(1, 2), (1, 3)]
    assert refs(manager.device, [0, 1, 2, 3]) == [3, 1, 1, 1]
    manager.check()


def test_num_new_blocks_for_two_shared_blocks_in_one_write():
    manager = make_manager(block_size=2)
    manager.allocate_slots(0, 0, 3)  # [0, 1], block 1 half full
    manager.fork(0, 1)
    # Rewriting from position 1 (as after a rollback) touches shared blocks 0 and 1, then one more.
    assert manager.num_new_blocks([(0, 1, 4)]) == 3
    manager.allocate_slots(0, 1, 4)
    assert manager.tables == {0: [2, 3, 4], 1: [0, 1]}
    assert manager.take_copies() == [(0, 2), (1, 3)]
    manager.check()


# ---- table updates for the executor ---------------------------------------------------------


def test_take_table_update_sends_the_full_table_once_then_appends():
    manager = make_manager(block_size=4)
    manager.allocate_slots(0, 0, 5)
    assert manager.take_table_update(0) == ([0, 1], True)
    assert manager.take_table_update(0) == ([], False)
    manager.allocate_slots(0, 5, 3)  # fits in block 1
    assert manager.take_table_update(0) == ([], False)
    manager.allocate_slots(0, 8, 5)
    assert manager.take_table_update(0) == ([2, 3], False)


def test_take_table_update_replaces_after_fork_and_copy_on_write():
    manager = make_manager(block_size=4)
    manager.allocate_slots(0, 0, 6)
    assert manager.take_table_update(0) == ([0, 1], True)
    manager.fork(0, 1)
    assert manager.take_table_update(1) == ([0, 1], True)  # the child is new to the executor
    manager.allocate_slots(0, 6, 1)  # copy-on-write: block 1 -> 2
    assert manager.take_table_update(0) == ([0, 2], True)
    manager.allocate_slots(1, 6, 1)  # in place
    assert manager.take_table_update(1) == ([], False)


def test_take_table_update_replaces_after_swap_in():
    manager = make_manager(block_size=4, num_device_blocks=4, num_cpu_blocks=4)
    manager.allocate_slots(0, 0, 5)
    assert manager.take_table_update(0) == ([0, 1], True)
    manager.swap_out([0])
    manager.allocate_slots(1, 0, 4)  # takes device block 2 meanwhile
    assert manager.swap_in([0]) == [(0, 3), (1, 0)]
    assert manager.take_table_update(0) == ([3, 0], True)
    assert manager.take_table_update(0) == ([], False)


def test_take_table_update_replaces_after_free_and_reallocation():
    manager = make_manager(block_size=4)
    manager.allocate_slots(0, 0, 4)
    assert manager.take_table_update(0) == ([0], True)
    manager.free(0)
    manager.allocate_slots(0, 0, 4)  # recompute: same seq id, fresh table
    assert manager.take_table_update(0) == ([1], True)


# ---- swapping -------------------------------------------------------------------------------


def test_swap_out_and_in_keeps_sharing():
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=1)
    manager.allocate_slots(0, 6, 1)  # seq 0: [0, 2], seq 1: [0, 1]; block 0 shared
    manager.take_copies()

    pairs = manager.swap_out([0, 1])
    assert pairs == [(0, 0), (2, 1), (1, 2)]  # shared block 0 moves once
    assert manager.tables == {}
    assert manager.cpu_tables == {0: [0, 1], 1: [0, 2]}
    assert refs(manager.cpu, [0, 1, 2]) == [2, 1, 1]
    assert manager.device.num_free == 8
    assert manager.cpu.num_free == 5
    assert manager.num_blocks_of([0, 1], cpu=True) == 3
    manager.check()

    # Device free list: 3..7 never used, then 2, 0, 1 in the order swap_out released them.
    pairs = manager.swap_in([0, 1])
    assert pairs == [(0, 3), (1, 4), (2, 5)]
    assert manager.cpu_tables == {}
    assert manager.tables == {0: [3, 4], 1: [3, 5]}
    assert refs(manager.device, [3, 4, 5]) == [2, 1, 1]
    assert manager.cpu.num_free == 8
    assert manager.device.num_free == 5
    manager.check()


def test_swap_out_of_a_forked_group_moves_each_block_once():
    manager = make_manager(block_size=4)
    make_shared(manager, 10, num_forks=3)  # 4 sequences share [0, 1, 2]
    assert manager.num_blocks_of([0, 1, 2, 3]) == 3
    pairs = manager.swap_out([0, 1, 2, 3])
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    assert refs(manager.cpu, [0, 1, 2]) == [4, 4, 4]
    assert manager.device.num_free == 8
    manager.check()


def test_swap_out_leaves_other_sequences_alone():
    manager = make_manager(block_size=4)
    manager.allocate_slots(0, 0, 4)  # [0]
    manager.allocate_slots(1, 0, 8)  # [1, 2]
    assert manager.swap_out([1]) == [(1, 0), (2, 1)]
    assert manager.tables == {0: [0]}
    assert manager.cpu_tables == {1: [0, 1]}
    assert manager.device.num_free == 7
    manager.check()


# ---- free -----------------------------------------------------------------------------------


def test_free_returns_every_block_of_every_pool():
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=2)
    manager.allocate_slots(1, 6, 3)  # copy-on-write for seq 1
    manager.allocate_slots(3, 0, 9)
    manager.swap_out([3])
    manager.check()
    for seq_id in (0, 1, 2, 3):
        manager.free(seq_id)
    assert_all_free(manager)


def test_free_of_one_fork_keeps_the_shared_blocks_alive():
    manager = make_manager(block_size=4)
    make_shared(manager, 6, num_forks=1)
    manager.free(0)
    assert manager.tables == {1: [0, 1]}
    assert refs(manager.device, [0, 1]) == [1, 1]
    assert manager.device.num_free == 6
    manager.check()
    manager.free(1)
    manager.free(1)  # freeing an unknown sequence is a no-op
    assert_all_free(manager)


# ---- check() --------------------------------------------------------------------------------


def test_check_detects_a_bumped_ref_count():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)
    manager.device.ref_counts[0] += 1
    with pytest.raises(AssertionError, match="device block 0"):
        manager.check()


def test_check_detects_a_table_entry_without_incref():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)
    manager.tables[1] = [0]
    with pytest.raises(AssertionError, match="device block 0: ref count 1, tables hold 2"):
        manager.check()


def test_check_detects_a_free_block_still_in_a_table():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)
    manager.device.decref(0)
    with pytest.raises(AssertionError, match="device block 0"):
        manager.check()


def test_check_detects_a_leaked_block():
    manager = make_manager()
    manager.device.allocate()  # referenced by no table
    with pytest.raises(AssertionError, match="device block 0: ref count 1, tables hold 0"):
        manager.check()


def test_check_detects_cpu_pool_corruption():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)
    manager.swap_out([0])
    manager.check()
    manager.cpu.ref_counts[0] = 0
    with pytest.raises(AssertionError, match="cpu block 0"):
        manager.check()


def test_check_detects_a_sequence_in_both_pools():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)
    manager.cpu_tables[0] = [manager.cpu.allocate()]
    with pytest.raises(AssertionError, match=r"sequences \[0\]"):
        manager.check()


def test_check_detects_a_free_list_that_disagrees_with_ref_counts():
    manager = make_manager()
    manager.allocate_slots(0, 0, 4)
    manager.device.ref_counts[0] = 0
    del manager.tables[0]  # ref counts agree with the tables, but block 0 is not on the free list
    with pytest.raises(AssertionError, match="free list differs"):
        manager.check()


def test_swapping_a_group_whose_sample_holds_no_blocks_yet():
    # After a recompute preemption a forked group may come back with only some samples
    # prefilled (the token budget reached the first); swapping it must skip the others.
    manager = BlockManager(block_size=4, num_device_blocks=4, num_cpu_blocks=4)
    manager.allocate_slots(0, 0, 6)
    pairs = manager.swap_out([0, 1])
    assert pairs == [(0, 0), (1, 1)]
    assert manager.cpu_tables == {0: [0, 1], 1: []}
    manager.check()
    assert manager.swap_in([0, 1]) == [(0, 2), (1, 3)]
    assert manager.tables == {0: [2, 3], 1: []}
    manager.check()


# ---- the lookahead plan's block work (grow_decodes) -------------------------------------------


def test_grow_decodes_sends_nothing_for_a_slot_in_a_held_block():
    manager = make_manager()
    manager.allocate_slots(0, 0, 3)  # one block, positions 0-2
    assert manager.take_table_update(0) == ([0], True)
    assert manager.writes_in_place(0, 3)
    assert manager.grow_decodes([(0, 3)]) == [([], False)]
    assert manager.tables[0] == [0]


def test_grow_decodes_takes_the_general_path_where_the_fast_one_does_not_apply():
    manager = make_manager()
    make_shared(manager, 6, 1)  # blocks 0, 1 shared by sequences 0 and 1
    manager.allocate_slots(2, 0, 4)  # sequence 2: one full block (2), never sent
    manager.take_table_update(0)
    manager.take_table_update(1)
    assert not manager.writes_in_place(0, 6)  # a shared block: copy-on-write
    assert not manager.writes_in_place(2, 4)  # a block boundary
    updates = manager.grow_decodes([(0, 6), (2, 4)])
    # Sequence 0 copies block 1 into 3 (its table is stale: sent whole); sequence 2 takes block
    # 4, and its table goes out whole too, never having been sent.
    assert updates == [([0, 3], True), ([2, 4], True)]
    assert manager.take_copies() == [(1, 3)]
    manager.check()


def test_grow_decodes_takes_nothing_when_the_new_blocks_do_not_fit():
    manager = make_manager(num_device_blocks=2)
    manager.allocate_slots(0, 0, 4)
    manager.allocate_slots(1, 0, 4)
    manager.take_table_update(0)
    manager.take_table_update(1)
    assert manager.grow_decodes([(0, 4), (1, 4)]) is None
    assert manager.tables == {0: [0], 1: [1]} and manager.device.num_free == 0
    manager.check()


def test_grow_decodes_leaves_a_sliding_window_to_the_general_path():
    manager = BlockManager(4, 8, 0, sliding_window=4)
    manager.allocate_slots(0, 0, 7)
    manager.take_table_update(0)
    assert not manager.writes_in_place(0, 7)  # a window may free blocks at any position
    # Position 8's query sees 5-8: block 0 (0-3) is freed, block 2 taken.
    assert manager.grow_decodes([(0, 8)]) == [([2], False)]
    assert manager.tables[0] == [-1, 1, 2]
