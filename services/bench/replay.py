"""Replay a trace through an in-process engine on a clock: virtual (the simulated executor's
modeled step times) or measured (the real executor's wall time per step, no HTTP)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.bench.traces import TraceRequest
from services.engine.llm_engine import LLMEngine
from services.scheduler.kv_accounting import KVAccountant, kv_breakdown
from shared.sampling import SamplingParams


@dataclass
class RequestRecord:
    arrival_s: float
    prompt_len: int
    output_len: int  # tokens generated
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    text: str = ""  # streamed text, for counting tokens when a server reports no usage


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    duration_s: float  # clock time from the first arrival to the last finish
    num_steps: int
    num_preemptions: int
    memory: dict[str, float]  # KV fractions, time-averaged over the whole run
    # ...and over the steps after which some request still waited for admission: the pool binds
    memory_saturated: dict[str, float]
    saturated_s: float
    max_running: int = 0
    mean_running: float = 0.0  # sequences in a step's batch, averaged over time
    num_computed_tokens: int = 0  # tokens whose K/V the steps computed (recomputation included)
    extra: dict = field(default_factory=dict)


def replay(engine: LLMEngine, trace: list[TraceRequest], progress: bool = False) -> ReplayResult:
    simulated = engine.config.executor == "sim"
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    records: dict[str, RequestRecord] = {}
    whole, saturated = KVAccountant(), KVAccountant()
    now = pending[0].arrival_s if pending else 0.0
    start = now
    max_running = 0
    running_seconds = 0.0  # sum of running sequences x step time
    tokens_before = engine.stats.num_batched_tokens
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(trace), desc="requests", unit="req", leave=False)
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            sampling = SamplingParams(
                max_tokens=request.output_len, temperature=0.0, ignore_eos=True
            )
            request_id = engine.add_request(list(request.prompt_token_ids), sampling)
            records[request_id] = RequestRecord(request.arrival_s, request.prompt_len, 0)
        if not engine.has_unfinished():
            now = pending[0].arrival_s  # idle until the next arrival
            continue
        sim_before = engine.stats.seconds.get("sim", 0.0)
        t0 = time.perf_counter()
        updates = engine.step()
        step_s = engine.stats.seconds["sim"] - sim_before if simulated else time.perf_counter() - t0
        now += step_s
        scheduler = engine.scheduler
        max_running = max(max_running, scheduler.num_running_seqs)
        running_seconds += engine.last_step_num_seqs * step_s
        breakdown = kv_breakdown(scheduler)
        whole.add(breakdown, step_s)
        if scheduler.waiting:
            saturated.add(breakdown, step_s)
        for update in updates:
            record = records[update.group.request_id]
            if update.new_tokens and record.first_token_s is None:
                record.first_token_s = now
            record.output_len += len(update.new_tokens)
            if update.finished:
                record.finish_s = now
                record.finish_reason = update.group.seqs[0].finish_reason
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return ReplayResult(
        records=list(records.values()),
        duration_s=now - start,
        num_steps=whole.num_steps,
        num_preemptions=engine.scheduler.num_preemptions,
        memory=whole.averages(),
        memory_saturated=saturated.averages(),
        saturated_s=saturated.seconds,
        max_running=max_running,
        mean_running=running_seconds / whole.seconds if whole.seconds else 0.0,
        num_computed_tokens=engine.stats.num_batched_tokens - tokens_before,
    )
