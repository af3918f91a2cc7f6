"""KV memory accounting: what each slot of the device pool holds after a step, and time averages.

Categories follow the paper's Figure 2. A slot allocated to a sequence holds a token state when
that token's K/V is cached, is reserved when a later token of the sequence will fill it, and is
internal fragmentation when none ever will (past the sequence's final length, which is
prompt + max_tokens: exact for benchmarks that set ignore_eos, an upper bound otherwise). A free
slot is external fragmentation when it lies in a run of free blocks too short for the request
waiting at the head of the queue (only contiguous allocators have any), else free. A free block
that still holds a cached prefix is free: it is evicted the moment anyone needs the memory.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from services.scheduler.kv_policy import final_len

KINDS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")


@dataclass
class KVBreakdown:
    """Token slots of the device pool by what they hold; the five add up to the pool."""

    token_states: int = 0
    reserved: int = 0
    internal_fragmentation: int = 0
    external_fragmentation: int = 0
    free: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def fractions(self) -> dict[str, float]:
        total = self.total or 1
        return {kind: getattr(self, kind) / total for kind in KINDS}


def kv_breakdown(scheduler) -> KVBreakdown:
    """Classify every device slot of `scheduler` (a Scheduler) as it stands between steps."""
    manager = scheduler.block_manager
    block_size = manager.block_size
    ref_counts = manager.device.ref_counts
    num_blocks = token_states = future_slots = 0
    # Blocks shared between sequences (forked samples) are classified one by one, by the owner
    # that has filled (or will fill) the most of them; unshared ones in closed form.
    filled: dict[int, int] = {}  # shared block id -> slots holding K/V
    future: dict[int, int] = {}  # shared block id -> slots filled by the owners' final lengths
    for group in scheduler.running:
        for seq in group.live_seqs():
            blocks = manager.held_blocks(seq.seq_id)
            if not blocks:
                continue
            stored = seq.num_computed_tokens
            final = max(final_len(seq.prompt_len, group.sampling, scheduler.max_seq_len), stored)
            if max(map(ref_counts.__getitem__, blocks)) == 1:
                capacity = len(blocks) * block_size
                num_blocks += len(blocks)
                token_states += min(stored, capacity)
                future_slots += min(final, capacity)
                continue
            for index, block_id in enumerate(blocks):
                base = index * block_size
                f = min(max(stored - base, 0), block_size)
                u = min(max(final - base, 0), block_size)
                filled[block_id] = max(filled.get(block_id, 0), f)
                future[block_id] = max(future.get(block_id, 0), u)
    num_blocks += len(filled)
    token_states += sum(filled.values())
    future_slots += sum(future.values())
    if num_blocks != manager.device.num_used:
        raise AssertionError(
            f"{manager.device.num_used} device blocks in use, running sequences hold {num_blocks}"
        )
    reserved = future_slots - token_states
    internal = num_blocks * block_size - future_slots
    unusable = 0
    if scheduler.waiting:
        need = manager.admission_blocks(scheduler.waiting[0])
        unusable = manager.unusable_free_blocks(need) * block_size
    free = manager.device.num_free * block_size - unusable
    return KVBreakdown(token_states, reserved, internal, unusable, free)


class KVAccountant:
    """Time-weighted averages of the breakdown's fractions over a run (the paper's Figure 2)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.num_steps = 0
        self._weighted = dict.fromkeys(KINDS, 0.0)

    def add(self, breakdown: KVBreakdown, seconds: float) -> None:
        for kind, value in breakdown.fractions().items():
            self._weighted[kind] += value * seconds
        self.seconds += seconds
        self.num_steps += 1

    def averages(self) -> dict[str, float]:
        if self.seconds <= 0:
            return dict.fromkeys(KINDS, 0.0)
        return {kind: value / self.seconds for kind, value in self._weighted.items()}
