"""The engine's one step loop: schedule, launch, collect, update, with the next step launched
behind the one in flight when it needs nothing of its result (async scheduling).

It lives beside the scheduler because the scheduler owns the loop; the executor is reached only
through an ExecutorLink, so the same core drives an executor object in this process (the
in-process engine, `local_executor.py`) and the executor process over ZeroMQ (the scheduler
service, `remote_executor.py`). The executor side mirrors the overlap: a plan that arrives
while a step runs is launched before that step's samples are collected.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from services.scheduler.kv_state import PreemptionLog
from services.scheduler.scheduler import GroupUpdate, Scheduler
from services.scheduler.step_loop import StepLoop
from shared.protocol import StepPlan, StepResult

T = TypeVar("T")


class ExecutorLink(Protocol):
    """What the core needs of an executor, wherever it runs."""

    async def launch(self, plan: StepPlan) -> Any:
        """Start the plan's step without waiting for it; returns what collect() takes."""

    async def collect(self, handle: Any) -> StepResult:
        """The launched step's result; a failure is StepResult.error, never an exception
        (a remote link raises only when the executor itself is gone)."""


@dataclass
class StepOutcome:
    plan: StepPlan
    result: StepResult
    updates: list[GroupUpdate]
    started_at: float  # perf_counter() when step() began
    launched_at: float  # ... when the plan went to the executor (an earlier step's, if ahead)
    collected_at: float  # ... when its result was back


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: ExecutorLink, overlap: bool) -> None:
        """overlap: launch the next step behind the one in flight when the scheduler can plan
        it without that step's result (Scheduler.schedule_ahead)."""
        self.scheduler = scheduler
        self.executor = executor
        self.overlap = overlap
        self.loop = StepLoop(scheduler)
        self.preemptions = PreemptionLog()  # for the block map (KvStateRequest)
        # (plan, what launch() returned, when) of a step launched ahead, not collected yet
        self._ahead: tuple[StepPlan, Any, float] | None = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._ahead is not None

    def has_schedulable(self) -> bool:
        """Whether step() has anything to do (grammar waits alone are not)."""
        return self._ahead is not None or self.scheduler.has_schedulable()

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    @property
    def schedule_s(self) -> float:
        """The last finished step's planning and update() seconds."""
        return self.loop.schedule_s

    async def step(self) -> StepOutcome:
        """One step, applied; raises NoProgressError when it did nothing with requests pending,
        and whatever the link raises when the executor is gone (then call forget())."""
        started_at = time.perf_counter()
        if self._ahead is not None:
            (plan, handle, launched_at), self._ahead = self._ahead, None
        else:
            plan, handle, launched_at = await self._plan_and_launch()
        if self.overlap:
            ahead = self.loop.plan_ahead()
            if ahead is not None:  # queued behind `plan` before its samples are read
                ahead_at = time.perf_counter()
                self._ahead = (ahead, await self.executor.launch(ahead), ahead_at)
        result = await self.executor.collect(handle)
        collected_at = time.perf_counter()
        updates = self.loop.finish(plan, result)
        return StepOutcome(plan, result, updates, started_at, launched_at, collected_at)

    async def launch_next(self) -> None:
        """With overlap, when no step is in flight: plan and launch the next one now, so the
        executor computes it while the caller publishes the last step's outputs (those are
        then off the critical path even where plan_ahead could not run: a speculating step's
        proposals need its predecessor's tokens). The plan is what step() would make next."""
        if self.overlap and self._ahead is None and self.scheduler.has_schedulable():
            self._ahead = await self._plan_and_launch()

    async def _plan_and_launch(self) -> tuple[StepPlan, Any, float]:
        scheduler = self.scheduler
        running_before, num_preemptions = list(scheduler.running), scheduler.num_preemptions
        plan = self.loop.plan()
        self.preemptions.note(running_before, num_preemptions, scheduler)
        launched_at = time.perf_counter()
        return plan, await self.executor.launch(plan), launched_at

    def forget(self) -> None:
        """The executor died with steps in flight: drop them (the scheduler's requeue_all
        recomputes their groups on the next executor)."""
        self._ahead = None
        self.loop.forget()


def run_now(step: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose every await is an in-process call, so it never suspends, to its
    end without an event loop (the in-process engine's steps)."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise RuntimeError("an in-process step waited for I/O: its executor link is not local")
