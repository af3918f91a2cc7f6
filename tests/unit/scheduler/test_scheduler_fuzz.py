"""Seeded random workloads through the scheduler alone: FCFS order, newest-first whole-group
victims, progress every step, no leak, everyone finishes; with shared prefixes, the prefix cache
hands out only blocks that hold the tokens asked for and keeps exact counts under eviction."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import SeqStatus
from services.scheduler.step_loop import StepLoop
from shared.config import SchedulerConfig
from shared.errors import InvalidRequestError
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams

EOS = 2


def _simulate(seed: int, shared_prefixes: bool = False) -> Scheduler:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_device_blocks = rng.randint(3, 24)
    chunked = rng.random() < 0.7
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 24) if chunked else rng.randint(1, 64),
        enable_chunked_prefill=chunked,
        preemption_mode=rng.choice(["swap", "recompute"]),
        watermark=rng.choice([0.0, 0.01, 0.1]),
        enable_prefix_caching=not shared_prefixes or rng.random() < 0.8,
    )
    ready = ExecutorReady(
        num_device_blocks=num_device_blocks,
        num_cpu_blocks=rng.randint(0, min(4, num_device_blocks)),
        block_size=block_size,
        max_model_len=rng.choice([16, 32, 64]),
        vocab_size=50,
        eos_token_ids=(EOS,),
    )
    scheduler = Scheduler(config, ready)
    loop = StepLoop(scheduler)
    pending = [
        (f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randint(1, 24))])
        for i in range(rng.randint(1, 10))
    ]
    if shared_prefixes:
        # A few prefixes over a 4-token alphabet: many requests share blocks, and the always
        # sampled token 7 makes output blocks collide too.
        prefixes = [[rng.randrange(3, 7) for _ in range(rng.randint(1, 16))] for _ in range(3)]
        pending = []
        for i in range(rng.randint(2, 12)):
            suffix = [rng.randrange(3, 7) for _ in range(rng.randint(0, 8))]
            pending.append((f"r{i}", rng.choice(prefixes) + suffix))
        evicted = _count_evictions(scheduler, [])
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            request_id, prompt = pending.pop(0)
            sampling = SamplingParams(
                n=rng.choice([1, 2, 3]), max_tokens=rng.randint(1, 40), seed=rng.randint(0, 9)
            )
            if shared_prefixes and rng.random() < 0.2:
                # Penalties: the executor must be fed every token, so nothing is reused.
                sampling = dataclasses.replace(sampling, repetition_penalty=1.3)
            try:
                scheduler.add_request(request_id, prompt, sampling)
            except InvalidRequestError:
                pass
        if scheduler.groups and rng.random() < 0.03:
            scheduler.abort(rng.choice(sorted(scheduler.groups)))
        running_before = list(scheduler.running)
        plan = loop.plan()
        scheduler.block_manager.check()
        _check_order_and_victims(scheduler, running_before, seed)
        if shared_prefixes and rng.random() < 0.01:
            # The executor died with this plan in flight: everything is recomputed.
            scheduler.requeue_all(ready)
            _count_evictions(scheduler, evicted)
            continue
        tokens = []
        for seq in plan.seqs:
            if seq.sample:
                for seq_id in (seq.seq_id, *seq.fork_seq_ids):
                    tokens.append(SampledToken(seq_id, EOS if rng.random() < 0.02 else 7))
        loop.finish(plan, StepResult(plan.step_id, tokens))  # raises if nothing moved
        scheduler.block_manager.check()
        _check_cached_content(scheduler, seed)
        if not pending and not scheduler.groups:
            if shared_prefixes:
                scheduler.num_evictions = len(evicted)
            return scheduler
    raise AssertionError(f"seed {seed}: requests still unfinished after 2000 steps")


def _count_evictions(scheduler: Scheduler, evicted: list[int]) -> list[int]:
    """Record the blocks the prefix cache evicts into `evicted`."""
    cache = scheduler.block_manager.prefix_cache
    if cache is not None:
        remove = cache.remove
        cache.remove = lambda block_id: (evicted.append(block_id), remove(block_id))[1]
    return evicted


def _check_cached_content(scheduler: Scheduler, seed: int) -> None:
    """Every cached block a running sequence holds within its computed tokens holds exactly
    that sequence's tokens there: a hit never hands out other K/V."""
    manager = scheduler.block_manager
    cache, bs = manager.prefix_cache, manager.block_size
    for group in scheduler.running:
        for seq in group.live_seqs():
            assert seq.num_computed_tokens <= seq.num_tokens, f"seed {seed}: overshot"
            if cache is None:
                continue
            table = manager.tables.get(seq.seq_id, [])
            for i in range(min(len(table), seq.num_computed_tokens // bs)):
                entry = cache._entry_of.get(table[i])
                if entry is not None:
                    want = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    assert entry.token_ids == want, (
                        f"seed {seed}: block {table[i]} holds other tokens"
                    )


def _arrivals(groups) -> list[int]:
    return [g.arrival for g in groups]


def _check_order_and_victims(scheduler: Scheduler, running_before: list, seed: int) -> None:
    """FCFS: queues in arrival order, victims the newest running groups (whole), and a group
    (re)enters `running` only ahead of every group still queued, never while one was preempted."""
    for queue in (scheduler.running, scheduler.swapped, scheduler.waiting):
        assert _arrivals(queue) == sorted(_arrivals(queue)), f"seed {seed}"
    running = set(map(id, scheduler.running))
    victims = [g for g in running_before if id(g) not in running and not g.is_finished]
    kept = [g for g in running_before if id(g) in running]
    if victims and kept:
        assert max(_arrivals(kept)) < min(_arrivals(victims)), f"seed {seed}: victim order"
    for group in victims:
        for seq in group.live_seqs():
            assert seq.seq_id not in scheduler.block_manager.tables, f"seed {seed}: partial"
            if seq.status is SeqStatus.WAITING:
                assert seq.num_computed_tokens == 0, f"seed {seed}"
            else:
                assert seq.status is SeqStatus.SWAPPED, f"seed {seed}"
    before = set(map(id, running_before))
    resumed = [g for g in scheduler.running if id(g) not in before]
    queued = list(scheduler.waiting) + list(scheduler.swapped)
    if resumed:
        assert not victims, f"seed {seed}: admitted beside a preemption"
        if queued:
            assert max(_arrivals(resumed)) < min(_arrivals(queued)), f"seed {seed}: FCFS"


@pytest.mark.parametrize("chunk", range(10))
def test_random_workloads_finish_without_leaks(chunk):
    for seed in range(chunk * 300, (chunk + 1) * 300):
        scheduler = _simulate(seed)
        manager = scheduler.block_manager
        assert manager.device.num_free == manager.device.num_blocks, f"seed {seed}"
        assert manager.cpu.num_free == manager.cpu.num_blocks, f"seed {seed}"
        assert not manager.tables and not manager.cpu_tables, f"seed {seed}"


@pytest.mark.parametrize("chunk", range(6))
def test_shared_prefix_workloads_keep_the_prefix_cache_exact_under_eviction(chunk):
    hits = evictions = 0
    for seed in range(chunk * 300, (chunk + 1) * 300):
        scheduler = _simulate(seed, shared_prefixes=True)
        manager = scheduler.block_manager
        assert manager.device.num_free == manager.device.num_blocks, f"seed {seed}"
        assert manager.cpu.num_free == manager.cpu.num_blocks, f"seed {seed}"
        assert not manager.tables and not manager.cpu_tables, f"seed {seed}"
        assert not manager._digests and not manager._num_offered, f"seed {seed}"
        hits += scheduler.prefix_cache_hit_tokens
        evictions += scheduler.num_evictions
    assert hits > 0 and evictions > 0  # the workloads did exercise reuse and eviction
