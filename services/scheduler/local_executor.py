"""An executor object in this process as the engine core's ExecutorLink: direct calls."""

from __future__ import annotations

from typing import Any

from shared.protocol import StepPlan, StepResult


class LocalExecutor:
    def __init__(self, executor: Any) -> None:
        """executor: anything with launch(plan) -> handle and collect(handle) -> StepResult
        (the real Executor, the simulator); typed loosely so the scheduler needs no torch."""
        self.executor = executor

    async def launch(self, plan: StepPlan) -> Any:
        return self.executor.launch(plan)

    async def collect(self, handle: Any) -> StepResult:
        return self.executor.collect(handle)
