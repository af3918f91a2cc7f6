"""The cost model on a worked example, the simulated executor at the paper's scale, and replay."""

from __future__ import annotations

import pytest

from services.bench.replay import replay
from services.bench.traces import TraceRequest
from services.engine.llm_engine import LLMEngine
from services.executor.cost_model import GPUS, MODELS, GpuSpec, ModelSpec, step_cost
from services.executor.sim import SimExecutor
from shared.config import EngineConfig, SchedulerConfig, SimConfig
from shared.protocol import ScheduledSeq, StepPlan

TOY_GPU = GpuSpec("toy", 1 << 30, hbm_bytes_per_s=1e9, peak_flops=1e12, pcie_bytes_per_s=1e8,
                  step_overhead_s=0.001)  # fmt: skip
# kv bytes per token: 2 (K and V) * 2 layers * 1 kv head * 4 dims * 2 bytes = 32
TOY_MODEL = ModelSpec("toy", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1,
                      head_dim=4, vocab_size=16, num_params=1000, dtype_bytes=2,
                      max_model_len=64, eos_token_id=2)  # fmt: skip


def _plan() -> StepPlan:
    prefill = ScheduledSeq(0, [5, 6, 7], 0, [0], True, sample=True)
    decode = ScheduledSeq(1, [8], 5, [], False, sample=True)
    return StepPlan(0, [prefill, decode], swap_in=[(3, 4)])


def test_cost_model_worked_example():
    cost = step_cost(_plan(), TOY_GPU, TOY_MODEL, block_size=4, overhead_s=0.001)
    assert TOY_MODEL.kv_bytes_per_token == 32
    # weights 2000 B + K/V read over the contexts (3 + 6 tokens) + written (4 tokens): 13 * 32
    assert cost.bytes_moved == 2000 + 13 * 32
    # linear 2 * (1000 - 128 head) * 4 tokens + head 2 * 128 * 2 sampled rows
    # + attention 4 * 2 layers * 2 heads * 4 dims * (1+2+3 prefill pairs + 6 decode pairs)
    assert cost.flops == 2 * 872 * 4 + 2 * 128 * 2 + 4 * 2 * 2 * 4 * 12 == 8256
    assert cost.memory_s == pytest.approx(2416e-9)
    assert cost.compute_s == pytest.approx(8256e-12)
    assert cost.swap_s == pytest.approx(4 * 32 / 1e8)  # one block of 4 tokens over PCIe
    assert cost.seconds == pytest.approx(2416e-9 + 1.28e-6 + 0.001)  # memory-bound
    slow = GpuSpec("slow", 1 << 30, 1e9, 1e6, 1e8, 0.0)
    assert step_cost(_plan(), slow, TOY_MODEL, 4, 0.0).seconds == pytest.approx(
        8256e-6 + 1.28e-6
    )  # compute-bound: FLOPs over peak wins
    assert step_cost(StepPlan(1, []), TOY_GPU, TOY_MODEL, 4, 0.001).seconds == 0.0


def test_opt13b_on_a100_at_the_papers_scale():
    gpu, model = GPUS["a100-40gb"], MODELS["opt-13b"]
    assert model.kv_bytes_per_token == 819_200  # 800 KB per token, as the paper says
    executor = SimExecutor(EngineConfig(executor="sim"))
    ready = executor.ready()
    assert (ready.num_device_blocks, ready.block_size) == (983, 16)  # 15,728 token slots
    assert ready.max_model_len == 2048 and ready.vocab_size == 50272
    # One decode at batch 1: the weights over HBM bandwidth dominate.
    plan = StepPlan(0, [ScheduledSeq(0, [9], 99, [0], True, sample=True)])
    cost = step_cost(plan, gpu, model, 16, 0.0)
    assert cost.memory_s == pytest.approx((25.7e9 + 101 * 819_200) / 1.555e12)
    result = executor.execute(plan)
    assert [t.token_id for t in result.tokens] == [3]
    assert result.timings["sim"] == pytest.approx(cost.seconds + gpu.step_overhead_s)
    assert executor.clock_s == result.timings["sim"]
    assert executor.ranks_alive()
    executor.close()  # the executor service and the engine call both
    with pytest.raises(ValueError, match="unknown sim GPU"):
        SimExecutor(EngineConfig(executor="sim", sim=SimConfig(gpu="tpu")))


def test_replay_on_the_virtual_clock_waits_for_arrivals():
    config = EngineConfig(executor="sim", scheduler=SchedulerConfig(kv_policy="orca-oracle"))
    engine = LLMEngine(config)
    trace = [
        TraceRequest(0.0, tuple(range(3, 103)), 10),
        TraceRequest(100.0, tuple(range(3, 53)), 5),
    ]
    result = replay(engine, trace)
    first, second = sorted(result.records, key=lambda r: r.arrival_s)
    assert (first.output_len, second.output_len) == (10, 5)
    assert first.finish_s < 100.0 <= second.first_token_s < second.finish_s
    # 10 + 5 steps, each one sampled token per request; the clock skipped the idle gap.
    assert result.num_steps == 15
    assert result.duration_s == pytest.approx(second.finish_s)
    assert result.memory["token_states"] > 0 and result.saturated_s == 0
    # Nothing preempted: each request computed its prompt and all but its last output token.
    assert result.num_computed_tokens == (100 + 9) + (50 + 4)
    # One sequence ran in every step (the requests never overlapped), none while idle.
    assert result.mean_running == pytest.approx(1.0)
    assert result.max_running == 1
