"""Allocation policies and KV accounting on hand-built cases: exact blocks, slots and fractions."""

from __future__ import annotations

import pytest

from services.scheduler.block_pool import BlockPool
from services.scheduler.contiguous import ContiguousAllocator
from services.scheduler.kv_accounting import KVAccountant, KVBreakdown, kv_breakdown
from services.scheduler.kv_policy import next_pow2, region_tokens
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.errors import InvalidRequestError
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams

TOKEN = 7


def make_scheduler(policy: str, num_device_blocks: int = 16, block_size: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0, kv_policy=policy)
    ready = ExecutorReady(
        num_device_blocks=num_device_blocks,
        num_cpu_blocks=num_device_blocks,
        block_size=block_size,
        max_model_len=64,
        vocab_size=100,
        eos_token_ids=(2,),
    )
    return Scheduler(config, ready)


def add(scheduler: Scheduler, request_id: str, length: int, max_tokens: int) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(request_id, list(range(10, 10 + length)), sampling)


def step(scheduler: Scheduler):
    plan = scheduler.schedule()
    scheduler.block_manager.check()
    tokens = [
        SampledToken(seq_id, TOKEN)
        for s in plan.seqs
        if s.sample
        for seq_id in (s.seq_id, *s.fork_seq_ids)
    ]
    scheduler.update(StepResult(plan.step_id, tokens))
    scheduler.block_manager.check()
    return plan


# ---- the contiguous allocator ---------------------------------------------------------------


def test_first_fit_allocator_fragments_on_a_worked_example():
    pool = BlockPool(10)
    allocator = ContiguousAllocator(pool)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.allocate(2) == [3, 4]
    assert allocator.allocate(4) == [5, 6, 7, 8]
    for block_id in (3, 4):
        pool.decref(block_id)
    # Three blocks are free, but in runs of 2 and 1: a 3-block region does not fit.
    assert allocator.free_runs() == [(3, 2), (9, 1)]
    assert pool.num_free == 3
    assert allocator.find(3) is None
    assert allocator.largest_free_run() == 2
    assert allocator.unusable_free_blocks(3) == 3
    assert allocator.unusable_free_blocks(2) == 1
    assert allocator.find(1) == 3  # first fit: the lowest run that is long enough
    assert allocator.allocate(1) == [3]
    assert allocator.free_runs() == [(4, 1), (9, 1)]


def test_region_sizes():
    s = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [next_pow2(n) for n in (1, 2, 3, 10, 16, 17)] == [1, 2, 4, 16, 16, 32]
    assert region_tokens("orca-max", 6, s, 64) == 64
    assert region_tokens("orca-pow2", 6, s, 64) == 16
    assert region_tokens("orca-oracle", 6, s, 64) == 10
    assert region_tokens("orca-pow2", 40, s, 48) == 48  # capped at the longest sequence


# ---- accounting per policy ------------------------------------------------------------------

# One request, prompt 6, max_tokens 4 (final length 10), block size 4, a 64-slot pool, after
# the prefill step: (blocks held, token states, reserved, internal fragmentation, free slots).
EXPECTED = {
    "paged": ([0, 1], 6, 2, 0, 56),  # blocks on demand: 8 slots for 6 tokens
    "orca-oracle": ([0, 1, 2], 6, 4, 2, 52),  # 10 slots rounded up to 3 blocks
    "orca-pow2": ([0, 1, 2, 3], 6, 4, 6, 48),  # 16 slots
    "orca-max": (list(range(16)), 6, 4, 54, 0),  # max_model_len = the whole 64-slot pool
}


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_accounting_of_one_request_per_policy(policy):
    scheduler = make_scheduler(policy)
    add(scheduler, "a", 6, max_tokens=4)
    plan = step(scheduler)
    blocks, tokens, reserved, internal, free = EXPECTED[policy]
    seq_id = plan.seqs[0].seq_id
    assert plan.seqs[0].block_ids == blocks[:2]  # the executor sees only blocks being written
    assert scheduler.block_manager.held_blocks(seq_id) == blocks
    breakdown = kv_breakdown(scheduler)
    assert breakdown == KVBreakdown(tokens, reserved, internal, 0, free)
    assert breakdown.fractions()["token_states"] == tokens / 64
    # Two more tokens: one more block under paged, nothing new under a reservation.
    step(scheduler)
    step(scheduler)
    after = kv_breakdown(scheduler)
    assert after.token_states == 8
    assert scheduler.block_manager.device.num_used == (2 if policy == "paged" else len(blocks))
    step(scheduler)  # the fourth token ends the request
    assert not scheduler.groups
    assert kv_breakdown(scheduler) == KVBreakdown(0, 0, 0, 0, 64)
    assert scheduler.block_manager.device.num_free == 16


def test_orca_external_fragmentation_blocks_admission():
    scheduler = make_scheduler("orca-oracle")
    add(scheduler, "a", 4, max_tokens=4)  # region of 8 slots: blocks 0-1
    add(scheduler, "b", 12, max_tokens=1)  # 13 slots: blocks 2-5, ends after its prefill
    add(scheduler, "c", 4, max_tokens=4)  # blocks 6-7
    add(scheduler, "d", 36, max_tokens=4)  # 40 slots: 10 blocks, only 8 (8-15) are free
    plan = step(scheduler)
    assert [s.seq_id for s in plan.seqs] == [0, 1, 2]
    assert scheduler.block_manager.allocator.free_runs() == [(2, 4), (8, 8)]
    # 12 free blocks, yet no run of 10: all 48 free slots are external fragmentation.
    assert kv_breakdown(scheduler) == KVBreakdown(8, 8, 0, 48, 0)
    plan = step(scheduler)
    assert [s.seq_id for s in plan.seqs] == [0, 2]  # d still waits
    assert [g.request_id for g in scheduler.waiting] == ["d"]


def test_paged_admits_what_orca_cannot():
    scheduler = make_scheduler("paged")
    for name, length, max_tokens in (("a", 4, 4), ("b", 12, 1), ("c", 4, 4), ("d", 36, 4)):
        add(scheduler, name, length, max_tokens)
    plan = step(scheduler)
    assert [s.seq_id for s in plan.seqs] == [0, 1, 2, 3]
    # a: 4 of 8, c: 4 of 8, d: 36 of 40; blocks 1+1+9, all full: no slot reserved yet.
    assert kv_breakdown(scheduler) == KVBreakdown(44, 0, 0, 0, 20)


def test_orca_policies_reject_parallel_sampling():
    scheduler = make_scheduler("orca-pow2")
    with pytest.raises(InvalidRequestError, match="n > 1"):
        scheduler.add_request("x", [10, 11], SamplingParams(n=2, max_tokens=4))
    assert not scheduler.groups


def test_accountant_weights_fractions_by_time():
    accountant = KVAccountant()
    accountant.add(KVBreakdown(token_states=3, free=1), seconds=1.0)
    accountant.add(KVBreakdown(token_states=1, reserved=1, free=2), seconds=3.0)
    averages = accountant.averages()
    assert averages["token_states"] == pytest.approx((0.75 * 1 + 0.25 * 3) / 4)
    assert averages["reserved"] == pytest.approx(0.25 * 3 / 4)
    assert averages["free"] == pytest.approx((0.25 + 0.5 * 3) / 4)
    assert sum(averages.values()) == pytest.approx(1.0)


def test_accounting_counts_shared_blocks_once():
    scheduler = make_scheduler("paged")
    scheduler.add_request(
        "p", list(range(10, 16)), SamplingParams(n=2, max_tokens=4, ignore_eos=True)
    )
    step(scheduler)
    # Both samples hold blocks 0-1 (6 tokens cached, final length 10 each).
    assert kv_breakdown(scheduler) == KVBreakdown(6, 2, 0, 0, 56)
    step(scheduler)
    # Position 6 written by both: one sample copied block 1; block 0 stays shared.
    assert scheduler.block_manager.device.num_used == 3
    assert kv_breakdown(scheduler) == KVBreakdown(4 + 3 + 3, 1 + 1, 0, 0, 52)
