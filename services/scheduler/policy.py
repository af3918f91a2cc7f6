"""The scheduling policy: which group goes first, which one yields, and which requests it accepts.

Every queue of the scheduler (waiting, running, swapped) is kept in the policy's order, smallest
`key` first, so one key answers every ordering question: the waiting queue is served from its
head, the preemption victim is the last running group, and a swapped group resumes before the
waiting head when its key is smaller. The mechanism (blocks, budgets, swaps) stays in the
scheduler; a new policy is a subclass here or in its own file plus one line in
services/scheduler/policies.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, MutableSequence, Sequence
from typing import Any, ClassVar

from services.scheduler.sequence import SequenceGroup
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams


class SchedulingPolicy:
    """The order of every queue and what follows from it; subclasses define `key`."""

    name: ClassVar[str]

    def key(self, group: SequenceGroup) -> Any:
        """The group's place in every queue: smaller goes first. It must not change while the
        group is queued, and ties are broken by arrival so that the order is total."""
        raise NotImplementedError

    def check_request(self, sampling: SamplingParams) -> None:
        """Admission: refuse (InvalidRequestError) a request this policy cannot honour."""

    def enqueue(self, queue: MutableSequence[SequenceGroup], group: SequenceGroup) -> None:
        """Put `group` into an ordered queue after every group that goes before or with it."""
        bisect.insort(queue, group, key=self.key)

    def ordered(self, groups: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        return sorted(groups, key=self.key)

    def victim(self, running: Sequence[SequenceGroup]) -> SequenceGroup:
        """The running group preempted when another cannot grow: the one that goes last."""
        return running[-1]

    def swapped_first(
        self, swapped: Sequence[SequenceGroup], waiting: Sequence[SequenceGroup]
    ) -> bool:
        """Whether the next group to (re)start is the head of `swapped` rather than `waiting`."""
        return bool(swapped) and (not waiting or self.key(swapped[0]) < self.key(waiting[0]))

    def admits_after_preemption(self) -> bool:
        """Whether a step that preempted may still start queued groups. The paper's rule is no:
        a preempted group would otherwise lose its blocks to a newer one and thrash."""
        return False


class FcfsPolicy(SchedulingPolicy):
    """The paper's first-come-first-served: earliest arrival first, the most recently arrived
    running group is the victim, and preempted groups (all older than never-run ones) resume
    before new ones start."""

    name = "fcfs"

    def key(self, group: SequenceGroup) -> int:
        return group.arrival

    def check_request(self, sampling: SamplingParams) -> None:
        # Refused, not ignored: a client that sets a priority expects it to matter.
        if sampling.priority != 0:
            raise InvalidRequestError(
                "priority needs a server started with --scheduling-policy priority; this one "
                "serves requests first come, first served",
                param="priority",
            )
