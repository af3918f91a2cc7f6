"""Seeded random workloads through the scheduler alone: no crash, no leak, everyone finishes."""

from __future__ import annotations

import random

import pytest

from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.errors import InvalidRequestError
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams

EOS = 2


def _simulate(seed: int) -> Scheduler:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_device_blocks = rng.randint(3, 24)
    chunked = rng.random() < 0.7
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=rng.randint(1, 8),
            max_num_batched_tokens=rng.randint(1, 24) if chunked else rng.randint(1, 64),
            enable_chunked_prefill=chunked,
            preemption_mode=rng.choice(["swap", "recompute"]),
            watermark=rng.choice([0.0, 0.01, 0.1]),
        ),
        ExecutorReady(
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=rng.randint(0, min(4, num_device_blocks)),
            block_size=block_size,
            max_model_len=rng.choice([16, 32, 64]),
            vocab_size=50,
            eos_token_ids=(EOS,),
        ),
    )
    pending = [
        (f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randint(1, 24))])
        for i in range(rng.randint(1, 10))
    ]
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            request_id, prompt = pending.pop(0)
            sampling = SamplingParams(
                n=rng.choice([1, 2, 3]), max_tokens=rng.randint(1, 40), seed=rng.randint(0, 9)
            )
            try:
                scheduler.add_request(request_id, prompt, sampling)
            except InvalidRequestError:
                pass
        if scheduler.groups and rng.random() < 0.03:
            scheduler.abort(rng.choice(sorted(scheduler.groups)))
        plan = scheduler.schedule()
        scheduler.block_manager.check()
        tokens = []
        for seq in plan.seqs:
            if seq.sample:
                for seq_id in (seq.seq_id, *seq.fork_seq_ids):
                    tokens.append(SampledToken(seq_id, EOS if rng.random() < 0.02 else 7))
        scheduler.update(StepResult(plan.step_id, tokens))
        scheduler.block_manager.check()
        if not pending and not scheduler.groups:
            return scheduler
    raise AssertionError(f"seed {seed}: requests still unfinished after 2000 steps")


@pytest.mark.parametrize("chunk", range(10))
def test_random_workloads_finish_without_leaks(chunk):
    for seed in range(chunk * 300, (chunk + 1) * 300):
        scheduler = _simulate(seed)
        manager = scheduler.block_manager
        assert manager.device.num_free == manager.device.num_blocks, f"seed {seed}"
        assert manager.cpu.num_free == manager.cpu.num_blocks, f"seed {seed}"
        assert not manager.tables and not manager.cpu_tables, f"seed {seed}"
