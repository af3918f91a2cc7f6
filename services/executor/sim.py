"""The simulated executor: answers plans like the real one, but runs no model and advances a
virtual clock by the cost model of a named GPU and model, with the KV pool sized as on that GPU.

Only the executor is replaced: the real scheduler and block manager run at the paper's scale on
a CPU. Every sampled token is the same non-EOS id, so requests run to max_tokens.
"""

from __future__ import annotations

import time

from services.executor.cost_model import GPUS, MODELS, kv_cache_bytes, step_cost
from services.executor.step_in_flight import StepInFlight
from shared.config import EngineConfig
from shared.protocol import ExecutorReady, SampledToken, StepPlan, StepResult


class SimExecutor:
    def __init__(self, config: EngineConfig) -> None:
        sim = config.sim
        if sim.gpu not in GPUS:
            raise ValueError(f"unknown sim GPU {sim.gpu!r}; known: {', '.join(GPUS)}")
        if sim.model not in MODELS:
            raise ValueError(f"unknown sim model {sim.model!r}; known: {', '.join(MODELS)}")
        self.gpu = GPUS[sim.gpu]
        self.model = MODELS[sim.model]
        self.realtime = sim.realtime
        self.overhead_s = (
            sim.step_overhead_s if sim.step_overhead_s is not None else self.gpu.step_overhead_s
        )
        self.block_size = config.cache.block_size
        block_bytes = self.block_size * self.model.kv_bytes_per_token
        pool_bytes = sim.kv_cache_bytes or kv_cache_bytes(self.gpu, self.model)
        self.num_device_blocks = config.cache.num_device_blocks or pool_bytes // block_bytes
        self.num_cpu_blocks = min(
            config.cache.swap_space_bytes // block_bytes, self.num_device_blocks
        )
        self.max_model_len = config.model.max_model_len or self.model.max_model_len
        if self.max_model_len > self.model.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds {self.model.name}'s "
                f"{self.model.max_model_len}"
            )
        # The id every sequence samples: any id that is not EOS.
        self.token_id = 3 if self.model.eos_token_id != 3 else 4
        self.clock_s = 0.0  # virtual seconds since start

    def ready(self) -> ExecutorReady:
        return ExecutorReady(
            num_device_blocks=self.num_device_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model.vocab_size,
            eos_token_ids=(self.model.eos_token_id,),
            device_type="sim",
        )

    def ranks_alive(self) -> bool:
        return True  # one simulated rank, always there

    def close(self) -> None:
        """Nothing to stop: the simulator has no other ranks."""

    def launch(self, plan: StepPlan) -> StepInFlight:
        """Simulated steps complete at once."""
        return StepInFlight(plan.step_id, result=self.execute(plan))

    def collect(self, flight: StepInFlight) -> StepResult:
        return flight.result

    def execute(self, plan: StepPlan) -> StepResult:
        seconds = step_cost(plan, self.gpu, self.model, self.block_size, self.overhead_s).seconds
        self.clock_s += seconds
        tokens = [
            SampledToken(seq_id, self.token_id)
            for seq in plan.seqs
            if seq.sample
            for seq_id in (seq.seq_id, *seq.fork_seq_ids)
        ]
        if self.realtime:
            time.sleep(seconds)
        return StepResult(plan.step_id, tokens, {"sim": seconds})
