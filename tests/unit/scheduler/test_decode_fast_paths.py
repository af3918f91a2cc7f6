"""The scheduler's decode fast paths (a plain decode found without the layer-part, row-cap and
prompt-share paths; a slot written in place without the pool's checks; the lookahead plan's
block work in one pass) plan exactly what the general paths plan: seeded random workloads,
synchronous and planned ahead, under preemption (swap and recompute), prefix caching, parallel
samples and the contiguous KV policies, run with the fast paths and with them turned off, give
the same plans step for step and the same outputs."""

from __future__ import annotations

import random

import pytest

from services.scheduler import scheduler as scheduler_module
from services.scheduler.block_manager import BlockManager
from services.scheduler.engine_core import EngineCore, run_now
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import PENDING_TOKEN, ExecutorReady, SampledToken, StepPlan, StepResult
from shared.sampling import SamplingParams

EOS = 2


class _RecordingLink:
    """An in-process executor link that records every plan and samples, for each sampling
    sequence, a token drawn from the plan entry itself (so that equal plans get equal tokens;
    now and then EOS)."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    async def launch(self, plan: StepPlan) -> StepPlan:
        self.plans.append(plan)
        return plan

    async def collect(self, plan: StepPlan) -> StepResult:
        tokens = []
        for seq in plan.seqs:
            if not seq.sample:
                continue
            for seq_id in (seq.seq_id, *seq.fork_seq_ids):
                rng = random.Random(seq_id * 100_003 + seq.start_pos + len(seq.token_ids))
                token = EOS if rng.random() < 0.04 else rng.randrange(3, 12)
                tokens.append(SampledToken(seq_id, token))
        return StepResult(plan.step_id, tokens)


def _run(seed: int, kv_policy: str, overlap: bool) -> tuple[list[StepPlan], dict]:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    config = SchedulerConfig(
        max_num_seqs=rng.randint(4, 24),
        max_num_batched_tokens=rng.choice([16, 64, 256]),
        preemption_mode=rng.choice(["swap", "recompute"]),
        enable_prefix_caching=rng.random() < 0.7,
        kv_policy=kv_policy,
        async_scheduling=overlap,
    )
    ready = ExecutorReady(
        num_device_blocks=rng.randint(24, 160),
        num_cpu_blocks=rng.randint(0, 40),
        block_size=block_size,
        max_model_len=128,
        vocab_size=50,
        eos_token_ids=(EOS,),
    )
    scheduler = Scheduler(config, ready)
    link = _RecordingLink()
    core = EngineCore(scheduler, link, overlap)
    prefix = [rng.randrange(3, 12) for _ in range(rng.randint(0, 24))]
    pending = [
        (f"r{i}", prefix + [rng.randrange(3, 50) for _ in range(rng.randint(1, 40))])
        for i in range(rng.randint(6, 30))
    ]
    outputs: dict = {}
    for _ in range(3000):
        while pending and rng.random() < 0.4:
            request_id, prompt = pending.pop(0)
            n = rng.choice([1, 1, 1, 2, 3]) if kv_policy == "paged" else 1  # (orca: n = 1)
            sampling = SamplingParams(n=n, max_tokens=rng.randint(1, 60), seed=seed)
            scheduler.add_request(request_id, prompt, sampling)
        if not core.has_unfinished():
            if not pending:
                break
            continue
        for update in run_now(core.step()).updates:
            group = update.group
            outputs[group.request_id] = [(s.token_ids, s.finish_reason) for s in group.seqs]
    assert not pending and not core.has_unfinished()
    return link.plans, outputs


@pytest.mark.parametrize("overlap", [True, False], ids=["ahead", "sync"])
@pytest.mark.parametrize(
    "seed,kv_policy",
    [(s, "paged") for s in range(8)] + [(8, "orca-max"), (9, "orca-pow2"), (10, "orca-oracle")],
)
def test_fast_paths_plan_what_the_general_paths_plan(monkeypatch, seed, kv_policy, overlap):
    plain_decodes = []
    plain_decode = scheduler_module._plain_decode

    def counted(live, budget):
        writes = plain_decode(live, budget)
        plain_decodes.append(writes is not None)
        return writes

    monkeypatch.setattr(scheduler_module, "_plain_decode", counted)
    fast_plans, fast_outputs = _run(seed, kv_policy, overlap)
    with monkeypatch.context() as general:
        general.setattr(scheduler_module, "_plain_decode", lambda live, budget: None)
        general.setattr(BlockManager, "writes_in_place", lambda self, seq_id, position: False)
        general_plans, general_outputs = _run(seed, kv_policy, overlap)
    assert fast_plans == general_plans
    assert fast_outputs == general_outputs
    # The comparison saw the fast paths at work: plain decodes, and (ahead) lookahead plans.
    assert sum(plain_decodes) > 20
    ahead = [p for p in fast_plans if p.seqs and p.seqs[0].token_ids == [PENDING_TOKEN]]
    assert (len(ahead) > 5) if overlap else not ahead
