"""The token budget's order: decode-first (running streams' tokens, then prompt chunks) or arrival.

Under FCFS admission a group still in its prompt is normally newer than every decoding group,
and both orders give the same plans. They differ when an older group is mid-prompt beside a
newer decoding one, so these cases are built by hand: groups moved into `running` with their
computed tokens' blocks allocated through the block manager.
"""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import SeqStatus, SequenceGroup
from tests.support.scheduler_steps import (
    TOKEN,
    add,
    make_scheduler,
    rows,
    run_until_done,
    step,
)


def scheduler_with(budget_order: str, **kwargs) -> Scheduler:
    scheduler = make_scheduler(**kwargs)
    # make_scheduler builds the default config; swap in the order under test.
    scheduler.config = replace(scheduler.config, budget_order=budget_order)
    return scheduler


def make_running(
    scheduler: Scheduler, group: SequenceGroup, computed: int, num_output: int = 0
) -> None:
    """Move a waiting group into `running` with `computed` tokens' K/V in device blocks and
    `num_output` sampled tokens (TOKEN) already appended."""
    scheduler.waiting.remove(group)
    scheduler.block_manager.admit(group)
    seq = group.seqs[0]
    seq.token_ids.extend([TOKEN] * num_output)
    scheduler.block_manager.allocate_slots(seq.seq_id, 0, computed)
    seq.num_computed_tokens = computed
    group.set_status(SeqStatus.RUNNING)
    scheduler.running.append(group)
    scheduler.running.sort(key=lambda g: g.arrival)


def mid_prompt_and_decoding(budget_order: str, **kwargs) -> Scheduler:
    """a (older) has 4 of its 20 prompt tokens computed; b (newer) is decoding."""
    scheduler = scheduler_with(budget_order, max_num_batched_tokens=8, **kwargs)
    a = add(scheduler, "a", 20, first=10)
    b = add(scheduler, "b", 3, first=40)
    make_running(scheduler, a, computed=4)
    make_running(scheduler, b, computed=3, num_output=1)
    scheduler.block_manager.check()
    return scheduler


def test_decode_first_gives_the_decoding_stream_its_token_before_an_older_prompt_chunk():
    scheduler = mid_prompt_and_decoding("decode-first")
    plan, _ = step(scheduler)
    # b decodes its one token (position 3); a's chunk takes the remaining 7 of the budget of 8.
    assert rows(plan) == [(1, [TOKEN], 3, True), (0, list(range(14, 21)), 4, False)]


def test_arrival_order_lets_the_older_prompt_chunk_take_the_whole_budget():
    scheduler = mid_prompt_and_decoding("arrival")
    plan, _ = step(scheduler)
    assert rows(plan) == [(0, list(range(14, 22)), 4, False)]


def tight_pool(budget_order: str, newest_decodes: bool) -> Scheduler:
    """6 blocks of 4 tokens. f (oldest) decodes in its 3 blocks; a is mid-prompt (1 block);
    the newest group, decoding or mid-prompt, holds 1 block. One block is free, and a's next
    chunk of 8 (positions 4..11) needs 2."""
    scheduler = scheduler_with(
        budget_order, max_num_batched_tokens=9, num_device_blocks=6, block_size=4
    )
    f = add(scheduler, "f", 11, first=60)
    a = add(scheduler, "a", 20, first=10)
    newest = add(scheduler, "n", 3 if newest_decodes else 20, first=40)
    make_running(scheduler, f, computed=11, num_output=1)
    make_running(scheduler, a, computed=4)
    if newest_decodes:  # its 4th token (the first sampled) goes into its one block
        make_running(scheduler, newest, computed=3, num_output=1)
    else:
        make_running(scheduler, newest, computed=4)
    scheduler.block_manager.check()
    assert scheduler.block_manager.device.num_free == 1
    return scheduler


def test_a_prompt_chunk_waits_rather_than_preempt_a_stream_already_served():
    scheduler = tight_pool("decode-first", newest_decodes=True)
    plan, _ = step(scheduler)
    assert [(s.seq_id, len(s.token_ids)) for s in plan.seqs] == [(0, 1), (2, 1)]
    assert scheduler.num_preemptions == 0
    assert [g.request_id for g in scheduler.running] == ["f", "a", "n"]


def test_arrival_order_preempts_the_newest_stream_for_an_older_prompt_chunk():
    scheduler = tight_pool("arrival", newest_decodes=True)
    plan, _ = step(scheduler)
    assert [(s.seq_id, len(s.token_ids)) for s in plan.seqs] == [(0, 1), (1, 8)]
    assert scheduler.num_preemptions == 1
    assert [g.request_id for g in scheduler.waiting] == ["n"]


def test_a_prompt_chunk_still_preempts_the_newest_group_when_it_was_not_served():
    # The newest group is mid-prompt too, so decode-first has not served it: it is the victim,
    # whole, and will be recomputed, as under arrival order.
    scheduler = tight_pool("decode-first", newest_decodes=False)
    plan, _ = step(scheduler)
    assert [(s.seq_id, len(s.token_ids)) for s in plan.seqs] == [(0, 1), (1, 8)]
    assert scheduler.num_preemptions == 1
    assert [g.request_id for g in scheduler.waiting] == ["n"]
    assert scheduler.groups["n"].seqs[0].num_computed_tokens == 0


def test_both_orders_finish_the_same_requests_with_the_same_tokens():
    outputs = {}
    for order in ("decode-first", "arrival"):
        scheduler = scheduler_with(order, max_num_batched_tokens=8, num_device_blocks=12)
        groups = [add(scheduler, f"r{i}", n, first=10 + i) for i, n in enumerate([9, 3, 14, 5])]
        run_until_done(scheduler)
        outputs[order] = [(g.seqs[0].finish_reason, g.seqs[0].output_token_ids) for g in groups]
    assert outputs["decode-first"] == outputs["arrival"]
    assert all(reason == "length" for reason, _ in outputs["arrival"])
