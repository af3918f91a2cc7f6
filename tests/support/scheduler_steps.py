"""Drive a Scheduler by hand without a model: made-up executor limits, chosen tokens, and
readers for the plans it returns."""

from __future__ import annotations

from services.scheduler.scheduler import GroupUpdate, Scheduler
from services.scheduler.sequence import SeqStatus, SequenceGroup
from shared.config import SchedulerConfig, SpeculativeConfig
from shared.protocol import ExecutorReady, SampledToken, StepPlan, StepResult
from shared.sampling import SamplingParams

VOCAB = 100
EOS = 2
TOKEN = 7  # what every sequence samples unless a test says otherwise


def make_scheduler(
    *,
    num_device_blocks: int = 16,
    num_cpu_blocks: int = 16,
    block_size: int = 4,
    max_model_len: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    preemption_mode: str = "recompute",
    watermark: float = 0.0,
    enable_prefix_caching: bool = True,
    speculative: SpeculativeConfig | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        preemption_mode=preemption_mode,
        watermark=watermark,
        enable_prefix_caching=enable_prefix_caching,
    )
    ready = ExecutorReady(
        num_device_blocks=num_device_blocks,
        num_cpu_blocks=num_cpu_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
    )
    return Scheduler(config, ready, speculative=speculative)


def prompt(length: int, first: int = 10) -> list[int]:
    """Token ids first, first + 1, ...: never EOS or TOKEN, easy to recognise in a plan."""
    return list(range(first, first + length))


def add(
    scheduler: Scheduler, request_id: str, length: int, first: int = 10, **sampling
) -> SequenceGroup:
    sampling.setdefault("max_tokens", 16)
    return scheduler.add_request(request_id, prompt(length, first), SamplingParams(**sampling))


def sampled(plan: StepPlan, tokens: dict[int, int] | None = None) -> list[SampledToken]:
    """One token per sampling sequence and per fork, plan order, children after their parent."""
    tokens = tokens or {}
    out = []
    for seq in plan.seqs:
        if seq.sample:
            for seq_id in (seq.seq_id, *seq.fork_seq_ids):
                out.append(SampledToken(seq_id, tokens.get(seq_id, TOKEN)))
    return out


def finish_step(
    scheduler: Scheduler, plan: StepPlan, tokens: dict[int, int] | None = None
) -> list[GroupUpdate]:
    updates = scheduler.update(StepResult(plan.step_id, sampled(plan, tokens)))
    scheduler.block_manager.check()
    return updates


def step(
    scheduler: Scheduler, tokens: dict[int, int] | None = None
) -> tuple[StepPlan, list[GroupUpdate]]:
    plan = scheduler.schedule()
    scheduler.block_manager.check()
    return plan, finish_step(scheduler, plan, tokens)


def steps(scheduler: Scheduler, count: int) -> list[StepPlan]:
    return [step(scheduler)[0] for _ in range(count)]


def run_until_done(scheduler: Scheduler, max_steps: int = 100) -> list[StepPlan]:
    plans = []
    for _ in range(max_steps):
        if not scheduler.groups:
            break
        plans.append(step(scheduler)[0])
    assert not scheduler.groups, (
        f"requests {sorted(scheduler.groups)} still unfinished after {max_steps} steps; "
        f"waiting={[g.request_id for g in scheduler.waiting]} "
        f"swapped={[g.request_id for g in scheduler.swapped]} "
        f"running={[g.request_id for g in scheduler.running]}"
    )
    return plans


def rows(plan: StepPlan) -> list[tuple[int, list[int], int, bool]]:
    return [(s.seq_id, s.token_ids, s.start_pos, s.sample) for s in plan.seqs]


def tables(plan: StepPlan) -> list[tuple[int, list[int], bool]]:
    return [(s.seq_id, s.block_ids, s.replace_table) for s in plan.seqs]


def ids(plan: StepPlan) -> list[int]:
    return [s.seq_id for s in plan.seqs]


def names(groups) -> list[str]:
    return [g.request_id for g in groups]


def assert_pools_free(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    manager.check()
    assert manager.tables == {} and manager.cpu_tables == {}
    assert manager.device.num_free == manager.device.num_blocks
    assert manager.cpu.num_free == manager.cpu.num_blocks


def assert_aborted(update: GroupUpdate | None, group: SequenceGroup) -> None:
    assert update is not None and update.group is group and update.finished
    assert [s.finish_reason for s in group.seqs] == ["abort"] * len(group.seqs)
    assert all(s.status is SeqStatus.FINISHED for s in group.seqs)


def contended(mode: str = "recompute", num_cpu_blocks: int = 4) -> Scheduler:
    """a and b (1 block each) grow in lockstep through a 4-block pool; c waits for a seat.

    After 5 steps both hold 2 full blocks and at step 5 a needs a third: b must go. The block
    ids below follow plain FIFO reuse, without a prefix cache (test_prefix_cache.py pins the
    cached order and reuse).
    """
    scheduler = make_scheduler(
        num_device_blocks=4,
        num_cpu_blocks=num_cpu_blocks,
        max_num_seqs=2,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    add(scheduler, "a", 4, first=10, max_tokens=8)
    add(scheduler, "b", 4, first=20, max_tokens=8)
    add(scheduler, "c", 4, first=30, max_tokens=2)
    for plan in steps(scheduler, 5):
        assert ids(plan) == [0, 1]
    assert scheduler.block_manager.tables == {0: [0, 2], 1: [1, 3]}
    assert scheduler.num_preemptions == 0
    return scheduler
