"""Scheduler defects found in review, each pinned by a test that failed before its fix."""

from __future__ import annotations

import copy

import pytest

from services.scheduler.sequence import SeqStatus, Sequence, SequenceGroup
from services.scheduler.step_loop import NoProgressError, StepLoop
from shared.protocol import StepPlan, StepResult
from shared.sampling import SamplingParams
from tests.support.scheduler_steps import (
    add,
    assert_aborted,
    assert_pools_free,
    contended,
    ids,
    make_scheduler,
    names,
    run_until_done,
    step,
)


def test_an_older_recompute_preempted_group_resumes_before_a_newer_swapped_one():
    # b and c are preempted in one step, newest first: c fits the one CPU block and is swapped,
    # b no longer fits and falls back to recompute. FCFS says b (older) comes back first.
    scheduler = make_scheduler(
        num_device_blocks=3, num_cpu_blocks=1, preemption_mode="swap", max_num_seqs=3
    )
    for name, first in [("a", 10), ("b", 30), ("c", 50)]:
        add(scheduler, name, 1, first=first, max_tokens=12)
    for _ in range(5):
        step(scheduler)
    assert names(scheduler.running) == ["a"]
    assert names(scheduler.waiting) == ["b"] and names(scheduler.swapped) == ["c"]
    while names(scheduler.running) == ["a"] or not scheduler.running:
        plan, _ = step(scheduler)
    assert ids(plan)[0] == 1  # b's sequence, not c's
    assert names(scheduler.running)[0] == "b"
    run_until_done(scheduler)
    assert_pools_free(scheduler)


def test_a_failed_step_does_not_finish_an_aborted_request_twice():
    scheduler = make_scheduler()
    a = add(scheduler, "a", 5)
    add(scheduler, "b", 3, first=20)
    plan = scheduler.schedule()
    assert_aborted(scheduler.abort("a"), a)
    updates = scheduler.update(StepResult(plan.step_id, [], error="boom"))
    assert [u.group.request_id for u in updates] == ["b"]
    assert [s.finish_reason for s in a.seqs] == ["abort"]
    assert_pools_free(scheduler)


def test_swap_out_victims_of_a_failed_step_are_recomputed_not_trusted_on_the_cpu():
    scheduler = contended("swap")
    b = scheduler.groups["b"]
    plan = scheduler.schedule()
    assert plan.swap_out == [(1, 0), (3, 1)]  # b's blocks would move in this plan
    updates = scheduler.update(StepResult(plan.step_id, [], error="failed in the cache moves"))
    assert [u.group.request_id for u in updates] == ["a"]  # a ran in the step: it ends
    assert scheduler.swapped == [] and scheduler.block_manager.cpu_tables == {}
    assert b.seqs[0].status is SeqStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert names(scheduler.waiting) == ["b", "c"]
    run_until_done(scheduler)
    assert b.seqs[0].num_output_tokens == 8
    assert_pools_free(scheduler)


def test_sequences_and_groups_compare_by_identity():
    seq = Sequence(0, 0, [10, 11], 2)
    group = SequenceGroup("r", 0, SamplingParams(), [seq])
    twin = copy.deepcopy(group)
    assert twin != group and twin not in [group]
    assert twin.seqs[0] != seq and twin.seqs[0] not in [seq]
    queue = [twin, group]
    queue.remove(group)
    assert queue[0] is twin
    assert len({group, twin}) == 2  # hashable by identity


class _Stuck:
    """A scheduler that has a request but never schedules or finishes anything."""

    def has_unfinished(self) -> bool:
        return True

    def schedule(self) -> StepPlan:
        return StepPlan(step_id=0, seqs=[])

    def update(self, result: StepResult) -> list:
        return []


def test_a_step_without_progress_is_an_error_for_every_caller():
    loop = StepLoop(_Stuck())
    plan = loop.plan()
    with pytest.raises(NoProgressError):
        loop.finish(plan, StepResult(plan.step_id, []))


# That the engine and the service run one step loop: tests/engine/test_engine_core.py.
