"""Per-sequence block tables kept on the device and updated from the plans' deltas.

A plan sends each sequence's blocks appended since the last plan (or the whole table when the
executor's copy is stale). Writing just those into a persistent [slots, max_blocks] tensor with
one scatter per step, and gathering the batch's rows on the device, keeps the per-step host work
proportional to what changed, not to every block of every running sequence.
"""

from __future__ import annotations

import torch

from kernels.metadata import host_to_device, int64_tensor


class DeviceBlockTables:
    def __init__(self, max_blocks_per_seq: int, device: torch.device, slots: int = 64) -> None:
        self.device = device
        self.max_blocks = max_blocks_per_seq
        # [slots, max_blocks] int64; columns past a sequence's length hold stale but valid ids.
        self.table = torch.zeros(slots, max_blocks_per_seq, dtype=torch.int64, device=device)
        self._slot: dict[int, int] = {}
        self._length: dict[int, int] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._writes: list[tuple[int, int, int]] = []  # (slot, column, block id) not yet applied
        # The last rows() answer, reused while no table has changed (most decode steps).
        self._last: tuple[list[int], torch.Tensor] | None = None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slot

    @property
    def slots(self) -> dict[int, int]:
        """seq_id -> its row of the table; read-only (a per-step membership test without a
        method call per sequence)."""
        return self._slot

    def length(self, seq_id: int) -> int:
        return self._length[seq_id]

    def register(self, seq_id: int) -> None:
        """A known sequence with an empty table (a fork child before its first plan entry)."""
        if seq_id not in self._slot:
            if not self._free:
                self._grow()
            self._slot[seq_id] = self._free.pop()
        self._length[seq_id] = 0
        self._last = None

    def update(self, seq_id: int, block_ids: list[int], replace: bool) -> None:
        if not block_ids and not replace and seq_id in self._slot:
            return  # most decode steps: the last block still has room
        if replace or seq_id not in self._slot:
            self.register(seq_id)
        start = self._length[seq_id]
        if start + len(block_ids) > self.max_blocks:
            raise ValueError(
                f"sequence {seq_id} would hold {start + len(block_ids)} blocks, "
                f"more than the {self.max_blocks} a sequence can"
            )
        slot = self._slot[seq_id]
        self._last = None
        self._writes.extend((slot, start + i, b) for i, b in enumerate(block_ids))
        self._length[seq_id] = start + len(block_ids)

    def forget(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self._last = None
            self._length.pop(seq_id)
            self._free.append(slot)
            # Writes still queued for it (a step that failed) must not reach its next owner.
            self._writes = [w for w in self._writes if w[0] != slot]

    def rows(self, seq_ids: list[int]) -> torch.Tensor:
        """[len(seq_ids), max blocks among them] int64 on the device, after pending writes."""
        if self._last is not None and self._last[0] == seq_ids:
            return self._last[1]
        if self._writes:
            # One value per cell: a scatter with repeated indices has no defined winner on a GPU.
            last = {(slot, col): block for slot, col, block in self._writes}
            flat = [(slot, col, block) for (slot, col), block in last.items()]
            writes = host_to_device(int64_tensor(flat).T, self.device)
            self.table[writes[0], writes[1]] = writes[2]
            self._writes = []
        width = max(max((self._length[s] for s in seq_ids), default=0), 1)
        slots = int64_tensor([self._slot[s] for s in seq_ids])
        rows = self.table[host_to_device(slots, self.device), :width]
        self._last = (list(seq_ids), rows)
        return rows

    def _grow(self) -> None:
        old = self.table.shape[0]
        table = torch.zeros(2 * old, self.max_blocks, dtype=torch.int64, device=self.device)
        table[:old] = self.table
        self.table = table
        self._free.extend(range(2 * old - 1, old - 1, -1))
