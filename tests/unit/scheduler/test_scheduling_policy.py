"""The scheduling-policy seam: FCFS keeps the paper's order; priority reorders every queue.

The scheduler is driven by hand as in test_scheduler.py (no model, no executor): schedule(),
then update() with one made-up token per sampling sequence.
"""

from __future__ import annotations

import pytest

from services.scheduler.policies import SCHEDULING_POLICIES, make_policy
from services.scheduler.policy import FcfsPolicy
from services.scheduler.priority_policy import PriorityPolicy
from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import SeqStatus, SequenceGroup
from shared.config import SchedulerConfig
from shared.errors import InvalidRequestError
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams

TOKEN = 7


def make_scheduler(policy: str, *, num_device_blocks: int = 16, max_num_seqs: int = 16, **kw):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        watermark=0.0,
        enable_prefix_caching=False,
        scheduling_policy=policy,
        **kw,
    )
    ready = ExecutorReady(
        num_device_blocks=num_device_blocks,
        num_cpu_blocks=16,
        block_size=4,
        max_model_len=64,
        vocab_size=100,
        eos_token_ids=(2,),
    )
    return Scheduler(config, ready)


def add(scheduler: Scheduler, name: str, first: int, priority: int = 0, max_tokens: int = 8):
    sampling = SamplingParams(max_tokens=max_tokens, priority=priority)
    return scheduler.add_request(name, list(range(first, first + 4)), sampling)


def step(scheduler: Scheduler) -> list[str]:
    """One step; the requests it scheduled, in plan order."""
    plan = scheduler.schedule()
    owner = {s.seq_id: g.request_id for g in scheduler.groups.values() for s in g.seqs}
    tokens = [SampledToken(s.seq_id, TOKEN) for s in plan.seqs if s.sample]
    scheduler.update(StepResult(plan.step_id, tokens))
    scheduler.block_manager.check()
    return [owner[s.seq_id] for s in plan.seqs]


def names(groups) -> list[str]:
    return [g.request_id for g in groups]


def run_until_done(scheduler: Scheduler) -> None:
    for _ in range(100):
        if not scheduler.groups:
            return
        step(scheduler)
    raise AssertionError(f"unfinished: {sorted(scheduler.groups)}")


# ---- the registry and FCFS ------------------------------------------------------------------


def test_the_registry_names_fcfs_and_priority_and_refuses_others():
    assert list(SCHEDULING_POLICIES) == ["fcfs", "priority"]
    assert isinstance(make_policy("fcfs"), FcfsPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)
    with pytest.raises(ValueError, match="fcfs, priority"):
        make_policy("lifo")
    assert isinstance(make_scheduler("fcfs").policy, FcfsPolicy)  # also the config's default
    assert SchedulerConfig().scheduling_policy == "fcfs"


def test_fcfs_orders_by_arrival_and_the_latest_arrival_yields():
    policy = FcfsPolicy()
    groups = [SequenceGroup(name, arrival, SamplingParams(), []) for name, arrival in
              [("c", 2), ("a", 0), ("b", 1)]]  # fmt: skip
    queue: list[SequenceGroup] = []
    for group in groups:
        policy.enqueue(queue, group)
    assert names(queue) == ["a", "b", "c"]
    assert names(policy.ordered(groups)) == ["a", "b", "c"]
    assert policy.victim(queue).request_id == "c"
    a, b, c = queue
    assert policy.swapped_first([a], [b]) and not policy.swapped_first([b], [a])
    assert policy.swapped_first([c], []) and not policy.swapped_first([], [a])
    assert not policy.admits_after_preemption()


def test_fcfs_refuses_a_priority_without_a_trace():
    scheduler = make_scheduler("fcfs")
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as info:
        add(scheduler, "a", 10, priority=1)
    assert info.value.param == "priority"
    assert scheduler.groups == {} and not scheduler.waiting
    assert add(scheduler, "b", 10).arrival == 0  # nothing was used up


# ---- priority -------------------------------------------------------------------------------


def test_a_higher_priority_late_arrival_is_admitted_first_and_fcfs_holds_within_a_level():
    scheduler = make_scheduler("priority", max_num_seqs=1)
    for name, first, priority in [("a", 10, 0), ("b", 20, 0), ("urgent", 30, -1), ("c", 40, 0)]:
        add(scheduler, name, first, priority, max_tokens=1)
    assert names(scheduler.waiting) == ["urgent", "a", "b", "c"]
    order = []
    while scheduler.groups:
        order += step(scheduler)
    assert order == ["urgent", "a", "b", "c"]


def test_under_fcfs_the_same_requests_run_in_arrival_order():
    scheduler = make_scheduler("fcfs", max_num_seqs=1)
    for name, first in [("a", 10), ("b", 20), ("late", 30)]:
        add(scheduler, name, first, max_tokens=1)
    order = []
    while scheduler.groups:
        order += step(scheduler)
    assert order == ["a", "b", "late"]


def contended(policy: str, priorities: dict[str, int], mode: str = "recompute") -> Scheduler:
    """Two groups (1 block each) grow in lockstep through a 4-block pool; after 5 steps each
    holds 2 full blocks and the first needs a third: one of them must be preempted."""
    scheduler = make_scheduler(policy, num_device_blocks=4, max_num_seqs=2, preemption_mode=mode)
    for name, first in [("first", 10), ("second", 20)]:
        add(scheduler, name, first, priorities.get(name, 0))
    for _ in range(5):
        step(scheduler)
    assert scheduler.num_preemptions == 0
    return scheduler


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_lower_priority_running_group_is_the_victim_even_when_it_arrived_first(mode):
    scheduler = contended("priority", {"first": 5, "second": 0}, mode)
    assert names(scheduler.running) == ["second", "first"]  # running is in policy order too
    first = scheduler.groups["first"]
    step(scheduler)
    assert scheduler.num_preemptions == 1
    assert names(scheduler.running) == ["second"]
    queue = scheduler.swapped if mode == "swap" else scheduler.waiting
    assert names(queue) == ["first"]
    expected = SeqStatus.SWAPPED if mode == "swap" else SeqStatus.WAITING
    assert first.seqs[0].status is expected
    run_until_done(scheduler)
    assert first.seqs[0].output_token_ids == [TOKEN] * 8  # it resumed and finished


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_within_one_level_the_latest_arrival_is_the_victim(policy):
    scheduler = contended(policy, {})
    step(scheduler)
    assert scheduler.num_preemptions == 1
    assert names(scheduler.running) == ["first"]
    assert names(scheduler.waiting) == ["second"]


def test_a_waiting_higher_priority_group_starts_before_a_swapped_lower_one_resumes():
    scheduler = contended("priority", {"first": 5, "second": 0}, mode="swap")
    step(scheduler)  # "first" is swapped out
    add(scheduler, "urgent", 30, priority=-1, max_tokens=1)
    add(scheduler, "later", 40, priority=9, max_tokens=1)
    assert scheduler.policy.swapped_first(scheduler.swapped, scheduler.waiting) is False
    assert names(scheduler.waiting) == ["urgent", "later"]
    started = []
    while scheduler.groups:
        for name in step(scheduler):
            if name not in started:
                started.append(name)
    assert started == ["second", "urgent", "first", "later"]


def test_restart_recovery_requeues_in_priority_order():
    scheduler = make_scheduler("priority", max_num_seqs=4)
    for name, first, priority in [("a", 10, 3), ("b", 20, 1), ("c", 30, 2)]:
        add(scheduler, name, first, priority)
    step(scheduler)
    assert names(scheduler.running) == ["b", "c", "a"]
    scheduler.requeue_all(
        ExecutorReady(
            num_device_blocks=16,
            num_cpu_blocks=16,
            block_size=4,
            max_model_len=64,
            vocab_size=100,
            eos_token_ids=(2,),
        )
    )
    assert names(scheduler.waiting) == ["b", "c", "a"]
