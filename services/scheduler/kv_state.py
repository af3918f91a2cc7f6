"""Snapshots of the block pools for the live block map, and the log of recent preemptions."""

from __future__ import annotations

import time
from collections import deque

from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import SeqStatus, SequenceGroup
from shared.packed import pack_ints
from shared.protocol import KvRequestState, KvState, PreemptionEvent

MAX_PREEMPTION_EVENTS = 32


class PreemptionLog:
    """Remembers which requests the last steps preempted and how.

    The service hands it the running groups as they were before schedule(); it only looks at
    them when the preemption counter moved, so a step without preemptions costs one comparison.
    """

    def __init__(self, size: int = MAX_PREEMPTION_EVENTS) -> None:
        self.events: deque[PreemptionEvent] = deque(maxlen=size)

    def note(self, running_before: list[SequenceGroup], num_before: int, scheduler: Scheduler):
        if scheduler.num_preemptions == num_before:
            return
        now = time.time()
        for group in running_before:
            live = group.live_seqs()
            # schedule() admits nothing while a group is preempted, so a group that was running
            # and now waits or sits in CPU memory was preempted by this step.
            if live and live[0].status is SeqStatus.SWAPPED:
                self.events.append(PreemptionEvent(now, group.request_id, "swap"))
            elif live and live[0].status is SeqStatus.WAITING:
                self.events.append(PreemptionEvent(now, group.request_id, "recompute"))


def kv_snapshot(scheduler: Scheduler, preemptions: PreemptionLog) -> KvState:
    """Who holds every device and CPU block, with reference counts; O(blocks + sequences)."""
    manager = scheduler.block_manager
    device_owners = [-1] * manager.device.num_blocks
    cpu_owners = [-1] * manager.cpu.num_blocks
    requests: list[KvRequestState] = []
    queues = (
        ("running", scheduler.running, manager.tables, device_owners),
        ("swapped", scheduler.swapped, manager.cpu_tables, cpu_owners),
        ("waiting", scheduler.waiting, manager.tables, device_owners),
    )
    for status, groups, tables, owners in queues:
        for group in groups:
            live = group.live_seqs()
            # Entries freed behind a sliding window (negative) hold no block.
            blocks = {b for seq in live for b in tables.get(seq.seq_id, ()) if b >= 0}
            for block_id in blocks:
                owners[block_id] = len(requests)
            requests.append(
                KvRequestState(
                    request_id=group.request_id,
                    status=status,
                    num_seqs=len(live),
                    num_prompt_tokens=len(group.prompt_token_ids),
                    num_output_tokens=max((s.num_output_tokens for s in group.seqs), default=0),
                    num_blocks=len(blocks),
                )
            )
    return KvState(
        time=time.time(),
        block_size=manager.block_size,
        device_ref_counts=pack_ints(manager.device.ref_counts),
        device_owners=pack_ints(device_owners),
        cpu_ref_counts=pack_ints(manager.cpu.ref_counts),
        cpu_owners=pack_ints(cpu_owners),
        cached_block_ids=manager.device.evictable_blocks(),
        requests=requests,
        preemptions=list(preemptions.events),
        num_preemptions=scheduler.num_preemptions,
    )
