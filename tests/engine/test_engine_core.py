"""The in-process engine and the scheduler service are two drivers of one EngineCore: the same
trace, through LLMEngine (the executor object) and through SchedulerService (the executor over
ZeroMQ, here a thread), runs only EngineCore.step and gives identical outputs, overlapped steps
and preemptions included. No processes start: the service runs on this test's event loop."""

from __future__ import annotations

import asyncio
import threading

import zmq
import zmq.asyncio

import services.engine.llm_engine as llm_engine
import services.scheduler.service as scheduler_service
from services.engine.llm_engine import LLMEngine
from services.scheduler.engine_core import EngineCore, run_now
from services.scheduler.service import SchedulerService
from shared.config import EngineConfig, SchedulerConfig
from shared.ipc import Addresses, make_socket, recv, recv_sync, send, send_sync
from shared.protocol import (
    PENDING_TOKEN,
    ExecutorReady,
    GatewayHello,
    GenerateRequest,
    SampledToken,
    SchedulerReady,
    Shutdown,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from shared.sampling import SamplingParams

EOS = 2
TRACE = [
    ([5, 6, 7, 8, 9], SamplingParams(max_tokens=14, temperature=0.0)),
    ([10, 11, 12], SamplingParams(n=2, max_tokens=9, temperature=0.0)),
    (list(range(3, 15)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
    ([20, 21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=11, temperature=0.0)),
    ([30, 31], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)),
]


class PositionExecutor:
    """Samples a token fixed by its position alone (EOS at every 13th), so outputs do not
    depend on how steps batch the requests; a small pool makes the scheduler preempt."""

    num_ahead = 0  # plans made ahead (inputs PENDING_TOKEN), over every instance

    def ready(self) -> ExecutorReady:
        return ExecutorReady(
            num_device_blocks=12,
            num_cpu_blocks=0,
            block_size=4,
            max_model_len=64,
            vocab_size=64,
            eos_token_ids=(EOS,),
        )

    def execute(self, plan: StepPlan) -> StepResult:
        tokens = []
        if any(seq.token_ids == [PENDING_TOKEN] for seq in plan.seqs):
            PositionExecutor.num_ahead += 1
        for seq in plan.seqs:
            if seq.sample:
                position = seq.start_pos + len(seq.token_ids)
                token = EOS if position % 13 == 12 else 3 + position % 40
                tokens += [SampledToken(i, token) for i in (seq.seq_id, *seq.fork_seq_ids)]
        return StepResult(plan.step_id, tokens)

    def launch(self, plan: StepPlan) -> StepResult:
        return self.execute(plan)

    def collect(self, result: StepResult) -> StepResult:
        return result

    def close(self) -> None:
        pass


def _record_core_steps(monkeypatch) -> list[EngineCore]:
    cores: list[EngineCore] = []
    step = EngineCore.step

    async def recorded(self: EngineCore):
        cores.append(self)
        return await step(self)

    monkeypatch.setattr(EngineCore, "step", recorded)
    return cores


def _in_process(monkeypatch) -> tuple[list, LLMEngine]:
    monkeypatch.setattr(llm_engine, "make_executor", lambda config: PositionExecutor())
    engine = LLMEngine(EngineConfig(executor="sim"), overlap_steps=True)
    outputs = engine.generate([p for p, _ in TRACE], [s for _, s in TRACE])
    return [[(o.token_ids, o.finish_reason) for o in out.outputs] for out in outputs], engine


def _serve_executor(addresses: Addresses) -> None:
    """The executor process's side of the pipes, in a thread: answer each plan at once."""
    ctx = zmq.Context()
    plans = make_socket(ctx, zmq.PULL, addresses.plans, bind=False)
    results = make_socket(ctx, zmq.PUSH, addresses.results, bind=False)
    executor = PositionExecutor()
    send_sync(results, executor.ready())
    try:
        while True:
            message = recv_sync(plans, timeout_ms=30_000)
            if message is None or isinstance(message, Shutdown):
                return
            if isinstance(message, StepPlan):
                send_sync(results, executor.execute(message))
    finally:
        ctx.destroy(linger=0)


async def _gateway(addresses: Addresses) -> dict[str, dict[int, tuple[list[int], str | None]]]:
    """Send the trace, gather every request's deltas until all have finished, stop the service."""
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, addresses.gateway, bind=False)
    try:
        await send(sock, GatewayHello())
        while not isinstance(await asyncio.wait_for(recv(sock), 30), SchedulerReady):
            pass
        for i, (prompt, sampling) in enumerate(TRACE):
            await send(sock, GenerateRequest(f"r{i}", prompt, sampling, 0.0))
        samples: dict[str, dict[int, tuple[list[int], str | None]]] = {}
        finished: set[str] = set()
        while len(finished) < len(TRACE):
            message = await asyncio.wait_for(recv(sock), 30)
            if not isinstance(message, TokenDeltas):
                continue
            for delta in message.all_deltas():  # most decode steps' as columns
                assert delta.error is None, delta.error
                by_index = samples.setdefault(delta.request_id, {})
                for seq in delta.seqs:
                    tokens, reason = by_index.get(seq.index, ([], None))
                    by_index[seq.index] = (tokens + seq.token_ids, seq.finish_reason or reason)
                if delta.finished:
                    finished.add(delta.request_id)
        await send(sock, Shutdown("test done"))
        return samples
    finally:
        ctx.destroy(linger=0)


def _served(monkeypatch, tmp_path) -> tuple[list, SchedulerService]:
    monkeypatch.setattr(scheduler_service, "freeze_startup_heap", lambda: None)
    addresses = Addresses.ipc(str(tmp_path))
    config = EngineConfig(executor="sim", scheduler=SchedulerConfig(async_scheduling=True))
    service = SchedulerService(config, addresses, "position")
    executor = threading.Thread(target=_serve_executor, args=(addresses,), daemon=True)
    executor.start()

    async def run() -> tuple[int, dict]:
        served = asyncio.create_task(service.run())
        samples = await _gateway(addresses)
        return await asyncio.wait_for(served, 30), samples

    exit_code, samples = asyncio.run(run())
    executor.join(30)
    assert exit_code == 0 and not executor.is_alive()
    outputs = [
        [samples[f"r{i}"][index] for index in sorted(samples[f"r{i}"])] for i in range(len(TRACE))
    ]
    return outputs, service


def test_the_engine_and_the_service_drive_one_core_to_the_same_outputs(monkeypatch, tmp_path):
    cores = _record_core_steps(monkeypatch)
    monkeypatch.setattr(PositionExecutor, "num_ahead", 0)
    expected, engine = _in_process(monkeypatch)
    assert cores and set(cores) == {engine.core}
    assert engine.scheduler.num_preemptions > 0 and PositionExecutor.num_ahead > 0
    del cores[:]
    PositionExecutor.num_ahead = 0
    got, service = _served(monkeypatch, tmp_path)
    assert cores and set(cores) == {service.core}
    assert PositionExecutor.num_ahead > 0  # the service overlapped steps too
    assert got == expected
    # Stops, lengths and a parallel sample: the comparison covers every way a sample ends.
    reasons = {reason for out in expected for _, reason in out}
    assert reasons == {"stop", "length"} and len(expected[1]) == 2


def _core_that_cannot_plan_ahead(monkeypatch, overlap: bool) -> tuple[EngineCore, list[int]]:
    """A core on the position executor whose scheduler never plans ahead (as when its next step
    speculates), and the step ids its executor was asked to launch, in order."""
    monkeypatch.setattr(llm_engine, "make_executor", lambda config: PositionExecutor())
    engine = LLMEngine(EngineConfig(executor="sim"), overlap_steps=overlap)
    monkeypatch.setattr(engine.scheduler, "schedule_ahead", lambda: None)
    launched: list[int] = []
    launch = engine.executor.launch

    def record(plan: StepPlan) -> StepResult:
        launched.append(plan.step_id)
        return launch(plan)

    monkeypatch.setattr(engine.executor, "launch", record)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return engine.core, launched


def test_launch_next_sends_the_next_plan_before_this_steps_outputs_are_handed_on(monkeypatch):
    core, launched = _core_that_cannot_plan_ahead(monkeypatch, overlap=True)
    first = run_now(core.step())
    assert launched == [first.plan.step_id]  # nothing was planned behind it
    run_now(core.launch_next())
    assert len(launched) == 2  # the next step is already with the executor
    run_now(core.launch_next())
    assert len(launched) == 2  # one at a time: a step in flight is not planned behind
    second = run_now(core.step())
    assert second.plan.step_id == launched[1]  # step() collects it instead of planning anew
    assert second.updates and second.updates[0].group.seqs[0].num_output_tokens == 2


def test_launch_next_waits_for_step_without_overlap(monkeypatch):
    core, launched = _core_that_cannot_plan_ahead(monkeypatch, overlap=False)
    run_now(core.step())
    run_now(core.launch_next())
    assert len(launched) == 1
