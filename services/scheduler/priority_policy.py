"""vLLM's priority scheduling: the request's `priority` first (lower is served first), then FCFS.

A running group of the lowest priority (the latest arrival among equals) is the preemption
victim, and a waiting group of a higher priority starts before an older swapped one resumes.
Queued groups are not preempted to admit a higher-priority arrival: it takes the next free room.
"""

from __future__ import annotations

from services.scheduler.policy import SchedulingPolicy
from services.scheduler.sequence import SequenceGroup


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def key(self, group: SequenceGroup) -> tuple[int, int]:
        return group.sampling.priority, group.arrival
