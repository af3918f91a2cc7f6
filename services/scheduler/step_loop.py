"""The scheduler's half of a step (plan, then update with the executor's result), timed, and the
progress rule; the engine core (`engine_core.py`) runs the executor between the two halves."""

from __future__ import annotations

import time
from typing import Protocol

from shared.protocol import StepPlan, StepResult


class NoProgressError(RuntimeError):
    """A step scheduled nothing and finished nothing while requests were pending.

    The policy's liveness rules (a group too big for the pool ends with "length", n above
    max_num_seqs is refused) make this impossible, so it is a bug: fail loudly rather than spin.
    """


class _Policy(Protocol):
    def has_unfinished(self) -> bool: ...
    def schedule(self) -> StepPlan: ...
    def schedule_ahead(self) -> StepPlan | None: ...
    def update(self, result: StepResult) -> list: ...


class StepLoop:
    def __init__(self, scheduler: _Policy) -> None:
        self.scheduler = scheduler
        self.num_steps = 0
        self.schedule_s = 0.0  # the last finished step: its planning + update()
        self._planning_s: dict[int, float] = {}  # step_id -> seconds spent planning it

    def plan(self) -> StepPlan:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self._planning_s[plan.step_id] = time.perf_counter() - t0
        return plan

    def plan_ahead(self) -> StepPlan | None:
        """The next step, planned while the one in flight runs, if it can be (async scheduling)."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule_ahead()
        if plan is not None:
            self._planning_s[plan.step_id] = time.perf_counter() - t0
        return plan

    def finish(self, plan: StepPlan, result: StepResult) -> list:
        """Apply the result of `plan`; raises NoProgressError when the step did nothing."""
        t0 = time.perf_counter()
        updates = self.scheduler.update(result)
        planning = self._planning_s.pop(plan.step_id, 0.0)
        self.schedule_s = planning + time.perf_counter() - t0
        self.num_steps += 1
        if not plan.seqs and not updates and self.scheduler.has_unfinished():
            raise NoProgressError("the scheduler made no progress with requests pending")
        return updates

    def forget(self) -> None:
        """Plans in flight were lost (the executor died): drop their planning times."""
        self._planning_s.clear()
