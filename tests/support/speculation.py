"""Engine runs for the speculative decoding tests: every step checks the block pool, and the
run must leave it exact and empty (rolled-back slots included)."""

from __future__ import annotations

from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams


def run_checked(config: EngineConfig, prompts, sampling: SamplingParams):
    """(each request's samples' tokens, the engine), the pool checked after every step and
    left exact and empty."""
    engine = LLMEngine(config)
    outputs = engine.generate(
        prompts, sampling, on_step=lambda e: e.scheduler.block_manager.check()
    )
    manager = engine.scheduler.block_manager
    manager.check()
    assert manager.device.num_free == manager.device.num_blocks
    assert manager.cpu.num_free == manager.cpu.num_blocks
    assert not manager.tables and not manager.cpu_tables
    return [[c.token_ids for c in o.outputs] for o in outputs], engine
