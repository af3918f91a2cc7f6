"""The plan log: one JSON line per step, which requests ran and which finished (it shows
iteration-level batching)."""

from __future__ import annotations

import json

from services.scheduler.scheduler import GroupUpdate, Scheduler
from shared.protocol import StepPlan


class PlanLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def write(self, scheduler: Scheduler, plan: StepPlan, updates: list[GroupUpdate]) -> None:
        group_of = {s.seq_id: g.request_id for g in scheduler.groups.values() for s in g.seqs}
        for update in updates:
            group_of.update({s.seq_id: update.group.request_id for s in update.group.seqs})
        line = {
            "step": plan.step_id,
            "requests": sorted({group_of.get(s.seq_id, "?") for s in plan.seqs}),
            "num_tokens": plan.num_tokens,
            "finished": sorted(u.group.request_id for u in updates if u.finished),
        }
        self._file.write(json.dumps(line) + "\n")
