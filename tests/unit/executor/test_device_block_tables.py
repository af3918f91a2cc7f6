"""Block tables kept on the device: deltas applied in order, slots reused, capacity grown."""

from __future__ import annotations

import torch

from services.executor.block_tables import DeviceBlockTables


def test_appends_replacements_and_reused_slots_give_exact_rows():
    tables = DeviceBlockTables(max_blocks_per_seq=6, device=torch.device("cpu"), slots=2)
    tables.update(10, [4, 5], replace=True)
    tables.update(11, [7], replace=True)
    tables.update(10, [9], replace=False)  # appended since the last plan
    assert tables.rows([10, 11])[:, :3].tolist() == [[4, 5, 9], [7, 0, 0]]
    tables.update(11, [2, 3], replace=True)  # copy-on-write: the whole table again
    assert tables.rows([11]).tolist() == [[2, 3]]
    tables.forget(10)
    tables.update(12, [8], replace=True)  # takes the freed slot; stale columns are not read
    tables.register(13)  # a fork child: known, empty, and the pool grows for it
    tables.update(13, [1, 6, 6], replace=True)
    assert tables.table.shape[0] == 4
    assert tables.rows([12, 13, 11]).tolist()[0][:1] == [8]
    assert tables.rows([13, 11]).tolist() == [[1, 6, 6], [2, 3, 0]]
    assert 10 not in tables and 13 in tables and tables.length(13) == 3


def test_a_forgotten_sequence_queued_writes_never_reach_the_next_owner():
    tables = DeviceBlockTables(max_blocks_per_seq=4, device=torch.device("cpu"), slots=1)
    tables.update(1, [5, 6, 7], replace=True)  # queued; the step then failed, never applied
    tables.forget(1)
    tables.update(2, [9], replace=True)  # same slot
    tables.update(2, [3], replace=True)  # replaced again before the next step: last one wins
    assert tables.rows([2]).tolist() == [[3]]
    assert tables.table[0, :3].tolist() == [3, 0, 0]


def test_rows_are_reused_until_a_table_changes():
    tables = DeviceBlockTables(max_blocks_per_seq=4, device=torch.device("cpu"), slots=2)
    tables.update(1, [5], replace=True)
    tables.update(2, [6], replace=True)
    first = tables.rows([1, 2])
    tables.update(1, [], replace=False)  # a decode whose last block has room
    assert tables.rows([1, 2]) is first  # the same gather: nothing changed
    assert tables.rows([2, 1]).tolist() == [[6], [5]]  # other rows, other answer
    tables.update(2, [8], replace=False)
    assert tables.rows([1, 2]).tolist() == [[5, 0], [6, 8]]
    tables.forget(2)
    tables.update(3, [9], replace=True)  # 2's slot, a new owner
    assert tables.rows([1, 3]).tolist() == [[5], [9]]
