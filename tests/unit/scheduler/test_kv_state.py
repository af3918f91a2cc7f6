"""The block map: snapshots of who holds which block, the preemption log, the wire and JSON."""

from __future__ import annotations

import pytest

from services.gateway.kv_state import kv_state_json
from services.scheduler.kv_state import PreemptionLog, kv_snapshot
from shared.packed import pack_ints, unpack_ints
from shared.wire import decode, encode
from tests.support.scheduler_steps import add, contended, finish_step, make_scheduler, step


def _step_with_log(scheduler, log: PreemptionLog) -> None:
    """What the scheduler service does around schedule()."""
    running_before, num_before = list(scheduler.running), scheduler.num_preemptions
    plan = scheduler.schedule()
    log.note(running_before, num_before, scheduler)
    finish_step(scheduler, plan)


def _by_id(state):
    return {r.request_id: (i, r) for i, r in enumerate(state.requests)}


def test_running_requests_own_their_device_blocks():
    scheduler = contended("swap")
    state = kv_snapshot(scheduler, PreemptionLog())
    assert [(r.request_id, r.status, r.num_blocks) for r in state.requests] == [
        ("a", "running", 2),
        ("b", "running", 2),
        ("c", "waiting", 0),
    ]
    assert unpack_ints(state.device_ref_counts) == [1, 1, 1, 1]
    assert unpack_ints(state.device_owners) == [0, 1, 0, 1]  # tables {a: [0, 2], b: [1, 3]}
    assert (
        unpack_ints(state.cpu_owners) == [-1] * 4 and unpack_ints(state.cpu_ref_counts) == [0] * 4
    )
    assert state.requests[0].num_output_tokens == 5 and state.requests[0].num_prompt_tokens == 4
    assert state.block_size == 4 and state.preemptions == [] and state.num_preemptions == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_request_is_logged_and_shown_where_its_blocks_went(mode):
    scheduler = contended(mode)
    log = PreemptionLog()
    _step_with_log(scheduler, log)
    state = kv_snapshot(scheduler, log)
    assert [(e.request_id, e.mode) for e in state.preemptions] == [("b", mode)]
    assert state.num_preemptions == 1
    index, b = _by_id(state)["b"]
    if mode == "swap":
        assert b.status == "swapped" and b.num_blocks == 2
        assert unpack_ints(state.cpu_owners) == [
            index,
            index,
            -1,
            -1,
        ]  # swapped out to cpu blocks 0 and 1
        assert unpack_ints(state.cpu_ref_counts) == [1, 1, 0, 0]
    else:
        assert b.status == "waiting" and b.num_blocks == 0
        assert unpack_ints(state.cpu_owners) == [-1] * 4
    assert index not in unpack_ints(state.device_owners)
    a_index, _ = _by_id(state)["a"]
    assert unpack_ints(state.device_owners).count(a_index) == 3
    _step_with_log(scheduler, log)  # a step without preemption adds nothing
    assert len(log.events) == 1


def test_parallel_samples_share_their_prompt_blocks():
    scheduler = make_scheduler(num_device_blocks=8)
    add(scheduler, "p", 8, n=3, max_tokens=4)
    step(scheduler)  # the prompt step forks: 2 full prompt blocks shared by 3 samples
    state = kv_snapshot(scheduler, PreemptionLog())
    assert state.requests[0].num_seqs == 3
    shared = [b for b, ref in enumerate(unpack_ints(state.device_ref_counts)) if ref == 3]
    assert len(shared) == 2
    assert all(unpack_ints(state.device_owners)[b] == 0 for b in shared)
    summary = kv_state_json(state)["summary"]
    assert summary["device_shared"] == 2
    assert summary["device_used"] == state.requests[0].num_blocks - 2
    assert summary["device_free"] == 8 - state.requests[0].num_blocks
    assert summary["num_running"] == 1 and summary["num_waiting"] == 0


def test_the_snapshot_crosses_the_wire_unchanged():
    scheduler = contended("swap")
    log = PreemptionLog()
    _step_with_log(scheduler, log)
    state = kv_snapshot(scheduler, log)
    assert decode(encode(state)) == state


def test_the_preemption_log_keeps_only_the_latest_events():
    log = PreemptionLog(size=2)
    for _ in range(3):
        scheduler = contended("recompute")
        _step_with_log(scheduler, log)
    assert len(log.events) == 2


def test_packed_arrays_round_trip():
    values = [0, 1, -1, 255, 65536, 2**31 - 1, -(2**31)]
    assert unpack_ints(pack_ints(values)) == values
    assert len(pack_ints(values)) == 4 * len(values)
