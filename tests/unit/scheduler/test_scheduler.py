"""The scheduling policy, driven by hand: schedule(), then update() with tokens the test picks.

No model and no executor: each test builds a Scheduler from an ExecutorReady it makes up and
asserts exact plans (seq ids, token ids, positions, block ids, swap and copy pairs).
"""

from __future__ import annotations

import pytest

from services.scheduler.sequence import SeqStatus
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from tests.support.scheduler_steps import (
    EOS,
    TOKEN,
    VOCAB,
    add,
    assert_aborted,
    assert_pools_free,
    contended,
    finish_step,
    ids,
    make_scheduler,
    names,
    prompt,
    rows,
    run_until_done,
    step,
    steps,
    tables,
)

# ---- admission, token budget, chunked prefill -----------------------------------------------


def test_requests_are_admitted_in_arrival_order():
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=4)
    scheduler.add_request("a", prompt(3, 10), params)
    scheduler.add_request("b", prompt(2, 20), params)
    scheduler.add_request("c", prompt(5, 30), params)

    plan, updates = step(scheduler)
    assert plan.step_id == 0
    assert rows(plan) == [
        (0, [10, 11, 12], 0, True),
        (1, [20, 21], 0, True),
        (2, [30, 31, 32, 33, 34], 0, True),
    ]
    assert tables(plan) == [(0, [0], True), (1, [1], True), (2, [2, 3], True)]
    assert [s.sampling for s in plan.seqs] == [params] * 3
    assert [u.group.request_id for u in updates] == ["a", "b", "c"]
    assert [[t.token_id for _, t in u.new_tokens] for u in updates] == [[TOKEN]] * 3

    plan, _ = step(scheduler)
    assert plan.step_id == 1
    assert rows(plan) == [(0, [TOKEN], 3, True), (1, [TOKEN], 2, True), (2, [TOKEN], 5, True)]
    assert tables(plan) == [(0, [], False), (1, [], False), (2, [], False)]
    assert [s.sampling for s in plan.seqs] == [None] * 3  # sent on first appearance only


def test_chunked_prefill_splits_a_prompt_into_budget_sized_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    group = add(scheduler, "a", 10)
    seq = group.seqs[0]

    plan, updates = step(scheduler)
    assert rows(plan) == [(0, [10, 11, 12, 13], 0, False)]
    assert tables(plan) == [(0, [0], True)]
    assert updates == []  # nothing sampled from a non-final chunk
    assert (seq.num_computed_tokens, seq.num_tokens) == (4, 10)

    plan, updates = step(scheduler)
    assert rows(plan) == [(0, [14, 15, 16, 17], 4, False)]
    assert tables(plan) == [(0, [1], False)]
    assert updates == []
    assert seq.num_computed_tokens == 8

    plan, updates = step(scheduler)
    assert rows(plan) == [(0, [18, 19], 8, True)]
    assert tables(plan) == [(0, [2], False)]
    assert seq.output_token_ids == [TOKEN]
    assert (seq.num_computed_tokens, seq.num_tokens) == (10, 11)

    plan, _ = step(scheduler)
    assert rows(plan) == [(0, [TOKEN], 10, True)]
    assert tables(plan) == [(0, [], False)]


def test_older_decodes_come_before_newer_prefill_chunks_within_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", 3)
    plan, _ = step(scheduler)
    assert rows(plan) == [(0, [10, 11, 12], 0, True)]

    add(scheduler, "b", 6, first=20)
    plans = steps(scheduler, 3)
    assert [rows(p) for p in plans] == [
        [(0, [TOKEN], 3, True), (1, [20, 21, 22], 0, False)],
        [(0, [TOKEN], 4, True), (1, [23, 24, 25], 3, True)],
        [(0, [TOKEN], 5, True), (1, [TOKEN], 6, True)],
    ]
    assert [p.num_tokens for p in plans] == [4, 4, 2]


def test_two_prompts_share_one_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", 3)
    add(scheduler, "b", 5, first=20)
    plans = steps(scheduler, 3)
    assert [rows(p) for p in plans] == [
        [(0, [10, 11, 12], 0, True), (1, [20], 0, False)],
        [(0, [TOKEN], 3, True), (1, [21, 22, 23], 1, False)],
        [(0, [TOKEN], 4, True), (1, [24], 4, True)],
    ]


def test_every_token_is_computed_once_and_no_plan_exceeds_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=5, num_device_blocks=64)
    groups = [
        add(scheduler, f"r{i}", length, first=10 + i, max_tokens=4)
        for i, length in enumerate([9, 1, 13, 4, 7])
    ]
    plans = run_until_done(scheduler)
    assert max(p.num_tokens for p in plans) <= 5
    for group in groups:
        seq = group.seqs[0]
        computed = [t for p in plans for s in p.seqs if s.seq_id == seq.seq_id for t in s.token_ids]
        assert computed == seq.token_ids[:-1]  # the last sampled token is never fed back
        assert seq.finish_reason == "length" and seq.num_output_tokens == 4
    assert_pools_free(scheduler)


def test_without_chunked_prefill_a_prompt_is_never_split():
    scheduler = make_scheduler(
        max_num_batched_tokens=4, enable_chunked_prefill=False, max_model_len=16
    )
    add(scheduler, "a", 10)
    add(scheduler, "b", 10, first=30)
    plans = steps(scheduler, 2)
    # The budget grows to max_model_len (16): b's 10 tokens do not fit next to a's, so b waits.
    assert rows(plans[0]) == [(0, prompt(10), 0, True)]
    assert rows(plans[1]) == [(0, [TOKEN], 10, True), (1, prompt(10, 30), 0, True)]
    plans += run_until_done(scheduler)
    assert all(s.sample for p in plans for s in p.seqs)
    assert_pools_free(scheduler)


# ---- max_num_seqs and continuous batching ---------------------------------------------------


def test_max_num_seqs_caps_running_and_a_waiting_request_joins_when_one_finishes():
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, "a", 3, max_tokens=2)
    add(scheduler, "b", 3, first=20, max_tokens=5)
    c = add(scheduler, "c", 3, first=30)

    plan, _ = step(scheduler)
    assert ids(plan) == [0, 1]
    assert names(scheduler.waiting) == ["c"]
    assert scheduler.num_running_seqs == 2

    plan, updates = step(scheduler)
    assert ids(plan) == [0, 1]
    assert [(u.group.request_id, u.finished) for u in updates] == [("a", True), ("b", False)]
    assert names(scheduler.waiting) == ["c"]

    plan, _ = step(scheduler)
    assert rows(plan) == [(1, [TOKEN], 4, True), (2, [30, 31, 32], 0, True)]
    assert plan.freed_seq_ids == [0]
    assert c.seqs[0].status is SeqStatus.RUNNING
    assert scheduler.num_running_seqs == 2


def test_max_num_seqs_reserves_a_seat_per_parallel_sample():
    scheduler = make_scheduler(max_num_seqs=3)
    add(scheduler, "a", 3, n=2, max_tokens=1)
    add(scheduler, "b", 3, first=20, n=2)
    plan, _ = step(scheduler)
    # a forks into 2 sequences at the end of this step; b's 2 would make 4 > 3.
    assert rows(plan) == [(0, prompt(3), 0, True)]
    assert plan.seqs[0].fork_seq_ids == [2]
    assert names(scheduler.waiting) == ["b"]
    assert sum(len(g.live_seqs()) for g in scheduler.running) <= 3
    plan, _ = step(scheduler)
    assert rows(plan) == [(1, [20, 21, 22], 0, True)]
    assert plan.freed_seq_ids == [0, 2]


# ---- preemption -----------------------------------------------------------------------------


def test_recompute_preemption_evicts_the_latest_group_and_requeues_it_by_arrival():
    scheduler = contended("recompute")
    b = scheduler.groups["b"]

    plan, _ = step(scheduler)
    assert scheduler.num_preemptions == 1
    assert rows(plan) == [(0, [TOKEN], 8, True)]
    assert tables(plan) == [(0, [1], False)]  # a reuses b's first freed block
    assert plan.swap_out == [] and plan.swap_in == []
    assert scheduler.block_manager.tables == {0: [0, 2, 1]}
    assert b.seqs[0].status is SeqStatus.WAITING
    assert b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].token_ids == prompt(4, 20) + [TOKEN] * 5  # tokens are kept
    assert names(scheduler.running) == ["a"]
    assert names(scheduler.waiting) == ["b", "c"]  # ahead of the later arrival

    # a finishes at step 7; b is prefilled again from scratch, prompt and outputs as one.
    plans = steps(scheduler, 3)
    assert [ids(p) for p in plans[:2]] == [[0], [0]]
    assert rows(plans[2]) == [
        (1, prompt(4, 20) + [TOKEN] * 5, 0, True),
        (2, prompt(4, 30), 0, True),
    ]
    assert tables(plans[2]) == [(1, [3, 0, 2], True), (2, [1], True)]
    assert plans[2].freed_seq_ids == [0]
    assert b.seqs[0].num_computed_tokens == 9
    assert scheduler.num_preemptions == 1


def test_swap_preemption_moves_blocks_out_and_back_and_keeps_computed_tokens():
    scheduler = contended("swap")
    b = scheduler.groups["b"]

    plan, _ = step(scheduler)
    assert scheduler.num_preemptions == 1
    assert plan.swap_out == [(1, 0), (3, 1)]
    assert plan.swap_in == []
    assert rows(plan) == [(0, [TOKEN], 8, True)]
    assert tables(plan) == [(0, [1], False)]
    assert scheduler.block_manager.cpu_tables == {1: [0, 1]}
    assert b.seqs[0].status is SeqStatus.SWAPPED
    assert b.seqs[0].num_computed_tokens == 8
    assert names(scheduler.swapped) == ["b"]
    assert names(scheduler.waiting) == ["c"]

    plans = steps(scheduler, 3)
    assert [ids(p) for p in plans[:2]] == [[0], [0]]
    assert [p.swap_in for p in plans[:2]] == [[], []]
    # a finished at step 7 and freed [0, 2, 1]; 3 was already free.
    assert plans[2].swap_in == [(0, 3), (1, 0)]
    assert plans[2].swap_out == []
    assert rows(plans[2]) == [(1, [TOKEN], 8, True), (2, prompt(4, 30), 0, True)]
    assert tables(plans[2]) == [(1, [3, 0, 2], True), (2, [1], True)]
    assert b.seqs[0].num_computed_tokens == 9
    assert b.seqs[0].status is SeqStatus.RUNNING
    assert scheduler.swapped == []
    assert scheduler.block_manager.cpu.num_free == 4
    run_until_done(scheduler)
    assert b.seqs[0].output_token_ids == [TOKEN] * 8
    assert_pools_free(scheduler)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_new_request_is_admitted_ahead_of_a_preempted_group(mode):
    scheduler = contended(mode)
    step(scheduler)  # b is preempted
    add(scheduler, "d", 1, first=40, max_tokens=1)  # would fit: 1 free block, 1 free seat
    for _ in range(2):
        assert scheduler.block_manager.device.num_free == 1
        assert scheduler.num_running_seqs == 1
        plan, _ = step(scheduler)
        assert ids(plan) == [0]
    assert names(scheduler.waiting) == ["c", "d"] if mode == "swap" else ["b", "c", "d"]
    plan, _ = step(scheduler)
    assert ids(plan) == [1, 2]  # b first, then c; d still waits for a seat
    assert names(scheduler.waiting) == ["d"]


def test_several_groups_are_preempted_latest_first():
    scheduler = make_scheduler(num_device_blocks=3)
    for name, first in [("a", 10), ("b", 20), ("c", 30)]:
        add(scheduler, name, 4, first=first)
    plan, _ = step(scheduler)
    assert ids(plan) == [0, 1, 2]

    plan, _ = step(scheduler)  # each needs a second block; none is free
    assert scheduler.num_preemptions == 2
    assert rows(plan) == [(0, [TOKEN], 4, True)]
    assert scheduler.block_manager.tables == {0: [0, 2]}
    assert names(scheduler.running) == ["a"]
    assert names(scheduler.waiting) == ["b", "c"]


def test_swap_mode_falls_back_to_recompute_without_cpu_blocks():
    scheduler = contended("swap", num_cpu_blocks=0)
    b = scheduler.groups["b"]
    plan, _ = step(scheduler)
    assert scheduler.num_preemptions == 1
    assert plan.swap_out == []
    assert scheduler.swapped == []
    assert names(scheduler.waiting) == ["b", "c"]
    assert b.seqs[0].status is SeqStatus.WAITING
    assert b.seqs[0].num_computed_tokens == 0
    assert scheduler.block_manager.tables == {0: [0, 2, 1]}
    run_until_done(scheduler)
    assert b.seqs[0].output_token_ids == [TOKEN] * 8
    assert_pools_free(scheduler)


def test_swap_mode_falls_back_to_recompute_when_the_cpu_pool_is_too_small():
    scheduler = contended("swap", num_cpu_blocks=1)  # b holds 2 blocks
    plan, _ = step(scheduler)
    assert plan.swap_out == []
    assert names(scheduler.waiting) == ["b", "c"]
    assert scheduler.block_manager.cpu.num_free == 1


# ---- parallel samples (n > 1) ---------------------------------------------------------------


def test_parallel_samples_fork_from_the_prompt_and_copy_on_write():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 6, n=3)

    plan, updates = step(scheduler, {0: 20, 1: 21, 2: 22})
    assert rows(plan) == [(0, prompt(6), 0, True)]
    assert plan.seqs[0].fork_seq_ids == [1, 2]
    assert tables(plan) == [(0, [0, 1], True)]
    assert [s.seq_id for s in group.seqs] == [0, 1, 2]
    assert [s.index for s in group.seqs] == [0, 1, 2]
    assert [s.output_token_ids for s in group.seqs] == [[20], [21], [22]]
    assert [s.num_computed_tokens for s in group.seqs] == [6, 6, 6]
    assert scheduler.block_manager.tables == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    assert scheduler.block_manager.device.ref_counts[:2] == [3, 3]
    [update] = updates
    assert [(s.seq_id, t.token_id) for s, t in update.new_tokens] == [(0, 20), (1, 21), (2, 22)]
    assert not update.finished

    # Block 1 holds 2 of 4 slots: the first two writers copy it, the last writes in place.
    plan, _ = step(scheduler)
    assert rows(plan) == [(0, [20], 6, True), (1, [21], 6, True), (2, [22], 6, True)]
    assert plan.copies == [(1, 2), (1, 3)]
    assert tables(plan) == [(0, [0, 2], True), (1, [0, 3], True), (2, [0, 1], True)]
    assert [s.sampling for s in plan.seqs] == [None] * 3
    assert scheduler.block_manager.device.ref_counts[:4] == [3, 1, 1, 1]

    plan, _ = step(scheduler)
    assert plan.copies == []
    assert tables(plan) == [(0, [], False), (1, [], False), (2, [], False)]


def test_parallel_samples_after_a_full_prompt_block_need_no_copies():
    scheduler = make_scheduler()
    add(scheduler, "a", 8, n=2)
    step(scheduler)
    assert scheduler.block_manager.device.ref_counts[:2] == [2, 2]
    plan, _ = step(scheduler)
    assert plan.copies == []
    assert tables(plan) == [(0, [2], False), (1, [0, 1, 3], True)]


def test_parallel_samples_fork_on_the_last_prompt_chunk_only():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    group = add(scheduler, "a", 6, n=2)
    plan, _ = step(scheduler)
    assert [(s.sample, s.fork_seq_ids) for s in plan.seqs] == [(False, [])]
    assert len(group.seqs) == 1
    plan, _ = step(scheduler)
    assert [(s.sample, s.fork_seq_ids) for s in plan.seqs] == [(True, [1])]
    assert [s.seq_id for s in group.seqs] == [0, 1]
    assert scheduler.block_manager.device.ref_counts[:2] == [2, 2]
    plan, _ = step(scheduler)
    assert plan.copies == [(1, 2)]


def test_parallel_samples_run_to_completion_with_exact_outputs():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5, n=4, max_tokens=6)
    run_until_done(scheduler)
    assert [s.output_token_ids for s in group.seqs] == [[TOKEN] * 6] * 4
    assert [s.finish_reason for s in group.seqs] == ["length"] * 4
    assert_pools_free(scheduler)


# ---- stop conditions ------------------------------------------------------------------------


def test_eos_stops_a_sequence_and_frees_its_blocks():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5)
    step(scheduler)
    plan, updates = step(scheduler, {0: EOS})
    [update] = updates
    assert update.finished and update.group is group
    assert group.seqs[0].finish_reason == "stop"
    assert group.seqs[0].output_token_ids == [TOKEN, EOS]
    assert scheduler.groups == {} and scheduler.running == []
    assert_pools_free(scheduler)
    plan, _ = step(scheduler)
    assert plan.seqs == [] and plan.freed_seq_ids == [0]
    assert step(scheduler)[0].freed_seq_ids == []  # announced once


def test_ignore_eos_generates_until_max_tokens():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5, max_tokens=3, ignore_eos=True)
    for _ in range(3):
        step(scheduler, {0: EOS})
    assert group.seqs[0].output_token_ids == [EOS] * 3
    assert group.seqs[0].finish_reason == "length"
    assert_pools_free(scheduler)


def test_stop_token_ids_stop_a_sequence():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5, stop_token_ids=(9,))
    step(scheduler)
    step(scheduler, {0: 9})
    assert group.seqs[0].output_token_ids == [TOKEN, 9]
    assert group.seqs[0].finish_reason == "stop"
    assert scheduler.groups == {}


def test_max_tokens_gives_length():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5, max_tokens=3)
    updates = [step(scheduler)[1] for _ in range(3)]
    assert [u.finished for [u] in updates] == [False, False, True]
    assert group.seqs[0].output_token_ids == [TOKEN] * 3
    assert group.seqs[0].finish_reason == "length"
    assert_pools_free(scheduler)


def test_the_model_length_limit_gives_length():
    scheduler = make_scheduler(max_model_len=8)
    group = add(scheduler, "a", 6, max_tokens=100)
    run_until_done(scheduler)
    assert group.seqs[0].num_tokens == 8
    assert group.seqs[0].finish_reason == "length"


def test_one_finished_sample_frees_only_its_own_blocks():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 8, n=2)
    step(scheduler)
    step(scheduler, {1: EOS})
    assert [s.finish_reason for s in group.seqs] == [None, "stop"]
    assert scheduler.block_manager.tables == {0: [0, 1, 2]}
    assert scheduler.block_manager.device.ref_counts[:4] == [1, 1, 1, 0]
    assert scheduler.num_running_seqs == 1
    plan, _ = step(scheduler)
    assert rows(plan) == [(0, [TOKEN], 9, True)]
    assert plan.freed_seq_ids == [1]


# ---- abort ----------------------------------------------------------------------------------


def test_abort_of_a_waiting_request():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5)
    assert_aborted(scheduler.abort("a"), group)
    assert scheduler.groups == {} and list(scheduler.waiting) == []
    plan, _ = step(scheduler)
    assert plan.seqs == [] and plan.freed_seq_ids == [0]
    assert_pools_free(scheduler)


def test_abort_of_a_running_forked_request_frees_every_block():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 6, n=3)
    add(scheduler, "b", 3, first=20)
    steps(scheduler, 2)
    assert scheduler.block_manager.device.num_free == 16 - 5
    assert_aborted(scheduler.abort("a"), group)
    assert names(scheduler.running) == ["b"]
    assert scheduler.block_manager.tables == {1: [2]}
    plan, _ = step(scheduler)
    assert ids(plan) == [1]
    assert plan.freed_seq_ids == [0, 2, 3]
    assert scheduler.abort("b") is not None
    assert_pools_free(scheduler)


def test_abort_of_a_swapped_request_frees_its_cpu_blocks():
    scheduler = contended("swap")
    step(scheduler)
    b = scheduler.groups["b"]
    assert scheduler.block_manager.cpu.num_free == 2
    assert_aborted(scheduler.abort("b"), b)
    assert scheduler.swapped == []
    assert scheduler.block_manager.cpu.num_free == 4
    assert scheduler.block_manager.cpu_tables == {}
    plan, _ = step(scheduler)
    assert rows(plan) == [(0, [TOKEN], 9, True), (2, prompt(4, 30), 0, True)]  # c is unblocked
    assert plan.freed_seq_ids == [1]
    run_until_done(scheduler)
    assert_pools_free(scheduler)


def test_abort_of_a_recompute_preempted_request():
    scheduler = contended("recompute")
    step(scheduler)
    b = scheduler.groups["b"]
    assert_aborted(scheduler.abort("b"), b)
    assert names(scheduler.waiting) == ["c"]
    run_until_done(scheduler)
    assert_pools_free(scheduler)


def test_abort_while_the_step_is_in_flight_does_not_resurrect_the_request():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 5)
    add(scheduler, "b", 3, first=20)
    plan = scheduler.schedule()
    assert ids(plan) == [0, 1]
    assert_aborted(scheduler.abort("a"), group)
    updates = finish_step(scheduler, plan)
    assert [u.group.request_id for u in updates] == ["b"]
    assert group.seqs[0].token_ids == prompt(5)  # the in-flight token was dropped
    assert "a" not in scheduler.groups and names(scheduler.running) == ["b"]
    assert scheduler.block_manager.tables == {1: [2]}
    plan, _ = step(scheduler)
    assert ids(plan) == [1] and plan.freed_seq_ids == [0]


def test_abort_in_flight_on_the_fork_step_forgets_the_children():
    scheduler = make_scheduler()
    group = add(scheduler, "a", 6, n=3)
    plan = scheduler.schedule()
    assert plan.seqs[0].fork_seq_ids == [1, 2]
    assert_aborted(scheduler.abort("a"), group)
    assert finish_step(scheduler, plan) == []
    assert [s.seq_id for s in group.seqs] == [0]  # no child was created
    assert_pools_free(scheduler)
    plan, _ = step(scheduler)
    assert plan.freed_seq_ids == [0, 1, 2]


def test_abort_of_an_unknown_or_finished_request_returns_none():
    scheduler = make_scheduler()
    assert scheduler.abort("nope") is None
    add(scheduler, "a", 3, max_tokens=1)
    step(scheduler)
    assert scheduler.abort("a") is None


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "empty"),
        ([5, VOCAB], "outside the vocabulary"),
        ([-1, 5], "outside the vocabulary"),
        ([5, 5.0], "outside the vocabulary"),
    ],
    ids=["empty", "too-high", "negative", "not-int"],
)
def test_add_request_rejects_bad_prompts_without_a_trace(tokens, message):
    scheduler = make_scheduler()
    first = add(scheduler, "ok", 3)
    with pytest.raises(InvalidRequestError, match=message) as info:
        scheduler.add_request("bad", tokens, SamplingParams())
    assert info.value.param == "prompt"
    assert scheduler.groups == {"ok": first}
    assert names(scheduler.waiting) == ["ok"]
    later = add(scheduler, "later", 3)
    assert (later.seqs[0].seq_id, later.arrival) == (1, 1)  # no id was used up


@pytest.mark.parametrize(
    ("max_model_len", "num_device_blocks"),
    [(8, 16), (64, 2)],
    ids=["model-limit", "pool-limit"],
)
def test_add_request_rejects_a_prompt_that_leaves_no_room(max_model_len, num_device_blocks):
    scheduler = make_scheduler(max_model_len=max_model_len, num_device_blocks=num_device_blocks)
    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_request("a", prompt(8), SamplingParams())
    assert info.value.code == "context_length_exceeded"
    assert scheduler.groups == {} and list(scheduler.waiting) == []
    group = add(scheduler, "a", 7, max_tokens=100)  # one slot left: one token to generate
    assert group.seqs[0].seq_id == 0
    run_until_done(scheduler)
    assert group.seqs[0].output_token_ids == [TOKEN]
    assert group.seqs[0].finish_reason == "length"


def test_add_request_rejects_a_duplicate_request_id():
    scheduler = make_scheduler()
    first = add(scheduler, "a", 3)
    with pytest.raises(InvalidRequestError, match="already in use"):
        add(scheduler, "a", 4)
    assert scheduler.groups == {"a": first}
    assert len(scheduler.waiting) == 1


# ---- a group that can never fit -------------------------------------------------------------


def test_a_group_that_outgrows_the_whole_pool_ends_with_length():
    # 4 samples of a 1-block prompt: 1 shared + 4 own blocks, then 4 more would be 9 > 8.
    scheduler = make_scheduler(num_device_blocks=8)
    group = add(scheduler, "a", 4, n=4, max_tokens=100)
    plans = steps(scheduler, 5)
    assert [len(p.seqs) for p in plans] == [1, 4, 4, 4, 4]
    assert scheduler.block_manager.device.num_free == 3

    plan, updates = step(scheduler)
    assert plan.seqs == []
    assert plan.freed_seq_ids == [0, 1, 2, 3]
    assert [(u.group.request_id, u.finished) for u in updates] == [("a", True)]
    assert [s.finish_reason for s in group.seqs] == ["length"] * 4
    assert [s.num_output_tokens for s in group.seqs] == [5] * 4
    assert scheduler.groups == {}
    assert_pools_free(scheduler)


# ---- liveness with preempted parallel samples -----------------------------------------------
# A preempted group sits ahead of every later arrival, so if it can never be scheduled again
# nothing behind it runs either (LLMEngine.step then raises "made no progress").


def test_recompute_preempted_parallel_samples_fit_the_token_budget_again():
    # b (n=2) is evicted by recompute after forking; each of its sequences then has 4+ tokens to
    # prefill again, and the budget is 4: the group needs a step that gives both sequences work.
    scheduler = make_scheduler(num_device_blocks=4, max_num_batched_tokens=4)
    add(scheduler, "a", 3, max_tokens=6)
    b = add(scheduler, "b", 3, first=20, n=2, max_tokens=6)
    steps(scheduler, 4)
    assert scheduler.num_preemptions == 1
    assert names(scheduler.waiting) == ["b"]
    assert [s.num_tokens for s in b.seqs] == [5, 5]
    add(scheduler, "c", 1, first=30, max_tokens=1)
    run_until_done(scheduler)
    assert [s.finish_reason for s in b.seqs] == ["length", "length"]
    assert_pools_free(scheduler)


def test_recompute_preempted_parallel_samples_fit_one_step_without_chunked_prefill():
    # Without chunking the budget is max_model_len (16) and a prompt is never split; b's two
    # sequences hold 14 tokens each, so both can never be prefilled in the same step.
    scheduler = make_scheduler(
        num_device_blocks=8,
        num_cpu_blocks=0,
        max_model_len=16,
        max_num_batched_tokens=4,
        enable_chunked_prefill=False,
    )
    add(scheduler, "a", 3, max_tokens=8)
    b = add(scheduler, "b", 8, first=20, n=2, max_tokens=8)
    steps(scheduler, 7)
    assert scheduler.num_preemptions == 1
    assert names(scheduler.waiting) == ["b"]
    assert [s.num_tokens for s in b.seqs] == [14, 14]
    add(scheduler, "c", 1, first=30, max_tokens=1)
    run_until_done(scheduler)
    assert all(s.is_finished for s in b.seqs)
    assert_pools_free(scheduler)


def test_recompute_preempted_parallel_samples_larger_than_the_pool_do_not_block_the_queue():
    # b's 4 samples share 2 prompt blocks; recomputed without sharing they need 4 * 3 = 12 > 8.
    scheduler = make_scheduler(num_device_blocks=8)
    add(scheduler, "a", 8, max_tokens=3)
    b = add(scheduler, "b", 8, first=20, n=4, max_tokens=6)
    steps(scheduler, 2)
    assert scheduler.num_preemptions == 1
    assert names(scheduler.waiting) == ["b"]
    add(scheduler, "c", 1, first=30, max_tokens=1)
    run_until_done(scheduler)
    assert all(s.is_finished for s in b.seqs)
    assert_pools_free(scheduler)


def test_swapped_parallel_samples_come_back_once_the_pool_is_free():
    # b (n=4) holds 5 of 8 blocks when it is swapped out; swap-in asks for 5 + 4 = 9 > 8.
    scheduler = make_scheduler(num_device_blocks=8, num_cpu_blocks=8, preemption_mode="swap")
    add(scheduler, "a", 11, max_tokens=3)
    b = add(scheduler, "b", 4, first=20, n=4, max_tokens=4)
    plans = steps(scheduler, 3)
    assert plans[2].swap_out == [(3, 0), (4, 1), (5, 2), (6, 3), (7, 4)]
    assert names(scheduler.swapped) == ["b"]
    assert scheduler.groups.keys() == {"b"}  # a has finished: the device pool is all free
    add(scheduler, "c", 1, first=30, max_tokens=1)
    run_until_done(scheduler)
    # Back on the device b needs no new block for its last 2 tokens (5 + 0 <= 8).
    assert [s.output_token_ids for s in b.seqs] == [[TOKEN] * 4] * 4
    assert_pools_free(scheduler)


def test_a_request_with_more_samples_than_max_num_seqs_does_not_block_the_queue():
    # n=3 can never get 3 seats out of 2: it is refused up front, without a trace.
    scheduler = make_scheduler(max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="max_num_seqs=2"):
        add(scheduler, "a", 3, n=3, max_tokens=2)
    assert scheduler.groups == {} and not scheduler.waiting
    add(scheduler, "b", 3, first=20, max_tokens=2)
    run_until_done(scheduler)
    assert_pools_free(scheduler)
