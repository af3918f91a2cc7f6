"""Prefix caching in the scheduler: admission reuses cached blocks, counts them right, and
recomputed parallel samples compute their prompt once."""

from __future__ import annotations

import pytest

from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import ExecutorReady, StepPlan
from shared.sampling import SamplingParams
from tests.support.scheduler_steps import (
    TOKEN,
    VOCAB,
    add,
    assert_pools_free,
    make_scheduler,
    names,
    prompt,
    rows,
    run_until_done,
    step,
    steps,
    tables,
)


def submit(scheduler: Scheduler, request_id: str, token_ids: list[int], **sampling):
    sampling.setdefault("max_tokens", 4)
    return scheduler.add_request(request_id, token_ids, SamplingParams(**sampling))


def test_a_later_request_reuses_the_computed_prefix_and_computes_only_the_rest():
    scheduler = make_scheduler()
    add(scheduler, "a", 10, max_tokens=4)
    plan, _ = step(scheduler)
    assert tables(plan) == [(0, [0, 1, 2], True)]
    submit(scheduler, "b", prompt(10) + [50, 51])
    plan, _ = step(scheduler)
    assert rows(plan) == [(0, [TOKEN], 10, True), (1, prompt(10)[8:] + [50, 51], 8, True)]
    assert tables(plan)[1] == (1, [0, 1, 3], True)
    manager = scheduler.block_manager
    assert [manager.device.ref_counts[b] for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert scheduler.prefix_cache_queried_tokens == 10 + 12
    assert scheduler.prefix_cache_hit_tokens == 8
    run_until_done(scheduler)
    assert_pools_free(scheduler)


def test_requests_admitted_in_one_step_compute_their_common_prefix_each():
    # Nothing is found before the step that writes it is reported; the second copy of the same
    # content is not cached, and a later request finds the first.
    scheduler = make_scheduler()
    add(scheduler, "a", 9)
    add(scheduler, "b", 9)
    plan, _ = step(scheduler)
    assert [r[2] for r in rows(plan)] == [0, 0]
    assert scheduler.block_manager.num_cached_blocks == 2
    add(scheduler, "c", 9)
    plan, _ = step(scheduler)
    assert tables(plan)[2] == (2, [0, 1, 6], True)
    assert rows(plan)[2][2] == 8


def test_chunked_prefill_continues_after_a_cached_prefix():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", 12, max_tokens=1)
    plans = steps(scheduler, 3)  # three chunks of 4; a samples once and ends
    assert [p.seqs[0].start_pos for p in plans] == [0, 4, 8]
    assert scheduler.block_manager.device.evictable_blocks() == [2, 1, 0]
    submit(scheduler, "b", prompt(12) + list(range(60, 68)))
    plans = steps(scheduler, 2)
    assert rows(plans[0]) == [(1, list(range(60, 64)), 12, False)]
    assert tables(plans[0]) == [(1, [0, 1, 2, 3], True)]
    assert rows(plans[1]) == [(1, list(range(64, 68)), 16, True)]
    assert scheduler.prefix_cache_hit_tokens == 12


def test_a_fully_cached_prompt_still_computes_its_last_block():
    scheduler = make_scheduler()
    add(scheduler, "a", 8, max_tokens=1)
    step(scheduler)
    add(scheduler, "b", 8, max_tokens=1)
    plan, _ = step(scheduler)
    assert rows(plan) == [(1, prompt(8)[4:], 4, True)]
    assert tables(plan) == [(1, [0, 2], True)]


def test_a_recompute_preempted_group_finds_its_own_blocks_again():
    # a and b grow in lockstep through a 4-block pool until a needs a third block; b's freed
    # blocks stay cached, a takes b's tail (least recently used first), and b comes back
    # computing only what was evicted.
    scheduler = make_scheduler(num_device_blocks=4, max_num_seqs=2)
    add(scheduler, "a", 4, first=10, max_tokens=8)
    b = add(scheduler, "b", 4, first=20, max_tokens=8)
    steps(scheduler, 5)
    assert scheduler.block_manager.tables == {0: [0, 2], 1: [1, 3]}
    plan, _ = step(scheduler)
    assert scheduler.num_preemptions == 1
    assert tables(plan) == [(0, [3], False)]  # b's output block went first
    assert scheduler.block_manager.device.evictable_blocks() == [1]
    plans = run_until_done(scheduler)
    [back] = [p for p in plans if 1 in [s.seq_id for s in p.seqs]][:1]
    assert rows(back)[0] == (1, [TOKEN] * 5, 4, True)  # the prompt block was found again
    assert tables(back)[0][1][0] == 1
    assert b.seqs[0].output_token_ids == [TOKEN] * 8
    assert_pools_free(scheduler)


def test_admission_counts_reused_blocks_that_others_hold_as_not_new():
    scheduler = make_scheduler()
    add(scheduler, "a", 10, max_tokens=8)
    step(scheduler)
    group = submit(scheduler, "b", prompt(10) + [50, 51, 52, 53, 54, 55])  # 16 tokens: 4 blocks
    manager = scheduler.block_manager
    reused = scheduler.prefix_reuse.lookup(scheduler.block_manager, group)
    assert reused == {group.seqs[0].seq_id: [0, 1]}
    assert manager.admission_blocks(group) == 4
    assert manager.admission_blocks(group, reused) == 2  # a holds blocks 0 and 1
    scheduler.abort("a")
    assert manager.admission_blocks(group, reused) == 4  # now they come out of the free ones


def test_requests_with_penalties_reuse_nothing():
    # The executor learns penalty counts from the tokens plans feed it.
    scheduler = make_scheduler()
    add(scheduler, "a", 10)
    step(scheduler)
    add(scheduler, "b", 10, repetition_penalty=1.3)
    plan, _ = step(scheduler)
    assert rows(plan)[1][2] == 0


def test_no_prefix_caching_and_orca_policies_reuse_nothing():
    scheduler = make_scheduler(enable_prefix_caching=False)
    add(scheduler, "a", 10)
    step(scheduler)
    add(scheduler, "b", 10)
    plan, _ = step(scheduler)
    assert rows(plan)[1][2] == 0
    assert scheduler.prefix_cache_queried_tokens == 0
    orca = Scheduler(
        SchedulerConfig(kv_policy="orca-oracle", enable_prefix_caching=True),
        ExecutorReady(16, 0, 4, 64, VOCAB, (2,)),
    )
    assert orca.block_manager.prefix_cache is None


# ---- recompute-preempted parallel samples ---------------------------------------------------


def prompt_positions(plans: list[StepPlan], seq_ids: set[int], end: int) -> int:
    """Prompt positions below `end` that these plans computed for these sequences."""
    return sum(
        max(0, min(s.start_pos + len(s.token_ids), end) - s.start_pos)
        for p in plans
        for s in p.seqs
        if s.seq_id in seq_ids
    )


def preempted_parallel_group(enable_prefix_caching: bool) -> tuple[Scheduler, object]:
    """b (n=3, 10-token prompt) forks, then is preempted by recompute when a needs blocks."""
    # b needs 2 shared + 3 x 4 own blocks, a 6: they cannot both finish in 16.
    scheduler = make_scheduler(num_device_blocks=16, enable_prefix_caching=enable_prefix_caching)
    add(scheduler, "a", 10, max_tokens=12)
    b = add(scheduler, "b", 10, first=30, n=3, max_tokens=12)
    for _ in range(12):
        step(scheduler)
        if scheduler.num_preemptions:
            break
    assert names(scheduler.waiting) == ["b"] and len(b.seqs) == 3
    return scheduler, b


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_a_recomputed_parallel_group_computes_its_prompt_once(caching):
    scheduler, b = preempted_parallel_group(caching)
    # Admission counts one copy of the two full prompt blocks, and each sample's tail.
    tails = sum(-(-s.num_tokens // 4) - 2 for s in b.seqs)
    assert scheduler.block_manager.admission_blocks(b) == 2 + tails
    plans = run_until_done(scheduler)
    seq_ids = {s.seq_id for s in b.seqs}
    full_prompt = 8  # two full blocks of the 10-token prompt
    computed = prompt_positions(plans, seq_ids, full_prompt)
    if caching:
        assert computed <= full_prompt  # the freed blocks may still be cached
    else:
        assert computed == full_prompt
        # The partial prompt block is each sample's own: it is computed per sample.
        assert prompt_positions(plans, seq_ids, 10) - computed == 3 * 2
    assert [s.output_token_ids for s in b.seqs] == [[TOKEN] * 12] * 3
    assert_pools_free(scheduler)


def test_recomputed_samples_wait_for_the_first_one_then_share_its_prompt_blocks():
    scheduler, b = preempted_parallel_group(enable_prefix_caching=False)
    first, *others = b.seqs
    b_ids = {s.seq_id for s in b.seqs}
    plan, _ = step(scheduler)
    while not b_ids & {s.seq_id for s in plan.seqs}:
        plan, _ = step(scheduler)
    # Only the first sample runs, from position 0; the others wait for its prompt blocks.
    [row] = [r for r in rows(plan) if r[0] in b_ids]
    assert row[:1] == (first.seq_id,) and row[2] == 0
    prompt_blocks = tables(plan)[-1][1][:2]
    # That step ended the first sample (its last token); its full prompt blocks were handed to
    # the others before they were freed.
    assert first.is_finished
    manager = scheduler.block_manager
    for seq in others:
        assert manager.tables[seq.seq_id] == prompt_blocks
        assert seq.num_computed_tokens == 8
    assert [manager.device.ref_counts[x] for x in prompt_blocks] == [2, 2]
    plan, _ = step(scheduler)
    assert [(r[0], r[2]) for r in rows(plan)] == [(s.seq_id, 8) for s in others]


def test_the_block_map_lists_free_blocks_that_still_hold_a_prefix():
    from services.scheduler.kv_state import PreemptionLog, kv_snapshot

    scheduler = make_scheduler()
    add(scheduler, "a", 9, max_tokens=1)
    step(scheduler)
    assert kv_snapshot(scheduler, PreemptionLog()).cached_block_ids == [1, 0]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_no_prefix_caching_flag_reaches_the_config_and_child_processes(command, capsys):
    import argparse

    from services.config_args import add_engine_args, engine_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = parser.parse_args([])
    assert engine_config_from_args(default).scheduler.enable_prefix_caching
    assert "--no-prefix-caching" not in engine_argv(default, None)
    off = parser.parse_args(["--no-prefix-caching"])
    assert not engine_config_from_args(off).scheduler.enable_prefix_caching
    assert "--no-prefix-caching" in engine_argv(off, None)  # serve passes it to the scheduler
    from services.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--no-prefix-caching" in capsys.readouterr().out
