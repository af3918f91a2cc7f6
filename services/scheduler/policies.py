"""The scheduling policies a server can run, by the name --scheduling-policy takes."""

from __future__ import annotations

from services.scheduler.policy import FcfsPolicy, SchedulingPolicy
from services.scheduler.priority_policy import PriorityPolicy

SCHEDULING_POLICIES: dict[str, type[SchedulingPolicy]] = {
    FcfsPolicy.name: FcfsPolicy,
    PriorityPolicy.name: PriorityPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in SCHEDULING_POLICIES:
        known = ", ".join(SCHEDULING_POLICIES)
        raise ValueError(f"scheduling_policy must be one of {known}, got {name!r}")
    return SCHEDULING_POLICIES[name]()
