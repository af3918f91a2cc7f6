"""A closed engine's KV pool is freed when the last reference goes, without the cycle collector.

A benchmark that builds engines back to back (`benchmarks/gpu_throughput.py`) must get each
pool back before it allocates the next: on a GPU a pool is most of the device's memory, and a
reference cycle would keep it until a collection happens to run.
"""

from __future__ import annotations

import gc
import weakref

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config


def test_a_deleted_engine_frees_its_kv_pool_without_a_collection(tiny_model_dir):
    engine = LLMEngine(engine_config(tiny_model_dir, num_device_blocks=32))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 2, 3, 4, 5]], greedy)  # every per-step structure has been used once
    pool = weakref.ref(engine.executor.cache.device)
    executor = weakref.ref(engine.executor)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        engine.close()
        del engine
        assert executor() is None, gc.get_referrers(executor())
        assert pool() is None
    finally:
        if was_enabled:
            gc.enable()
