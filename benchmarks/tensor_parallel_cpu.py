"""Tensor-parallel overhead on the CPU: the same model and workload at size 1 and size 2.

A seeded random Llama (8 heads, 4 KV heads, so it splits in two) runs a greedy offline
workload through the in-process engine three ways: one rank with all the torch threads, one
rank with one thread, and two gloo ranks with one thread each (the same cores as the first).
On one machine this measures what the split costs (all-reduces, plan broadcasts, smaller
GEMMs) against what a second independent process gains, not a multi-device speed-up.

    .venv/bin/python benchmarks/tensor_parallel_cpu.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.bench.random_models import make_tiny_llama
from services.engine.llm_engine import LLMEngine
from shared.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from shared.sampling import SamplingParams


def run(config, prompts, max_tokens: int) -> dict:
    with LLMEngine(config) as engine:
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        engine.stats.num_steps = 0
        start = time.perf_counter()
        outputs = engine.generate(prompts, greedy)
        elapsed = time.perf_counter() - start
        steps = engine.stats.num_steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "ms_per_step": 1000 * elapsed / steps,
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", default="benchmarks/results/tensor_parallel_cpu.json")
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny test model: checks it runs, no figure"
    )
    args = parser.parse_args()
    shape = dict(
        vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
        max_positions=512,
    )  # fmt: skip
    if args.smoke:
        shape = dict(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model_dir = make_tiny_llama(Path(tempfile.mkdtemp()) / "tp-bench", **shape)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, shape["vocab_size"]) for _ in range(args.input_len)]
        for _ in range(args.num_requests)
    ]
    # No swap pool: the workload fits the device pool, nothing is preempted.
    base = EngineConfig(
        model=ModelConfig(
            model=str(model_dir), dtype="float32", device="cpu", attention_backend="torch"
        ),
        cache=CacheConfig(num_device_blocks=512, swap_space_bytes=0),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256),
    )
    threads = torch.get_num_threads()
    one = run(base, prompts, args.output_len)
    single = dataclasses.replace(base, model=dataclasses.replace(base.model, num_threads=1))
    one_thread = run(single, prompts, args.output_len)
    torch.set_num_threads(threads)
    two = run(
        dataclasses.replace(base, parallel=ParallelConfig(tensor_parallel_size=2)),
        prompts,
        args.output_len,
    )
    result = {
        "command": "benchmarks/tensor_parallel_cpu.py " + " ".join(sys.argv[1:]),
        "torch_threads": threads,
        "shape": shape,
        "workload": vars(args),
        "size_1": {k: v for k, v in one.items() if k != "tokens"},
        "size_1_one_thread": {k: v for k, v in one_thread.items() if k != "tokens"},
        "size_2": {k: v for k, v in two.items() if k != "tokens"},
        "size_2_over_size_1_step_time": two["ms_per_step"] / one["ms_per_step"],
        "size_2_over_size_1_one_thread_step_time": two["ms_per_step"] / one_thread["ms_per_step"],
        "identical_greedy_outputs": one["tokens"] == two["tokens"] == one_thread["tokens"],
    }
    print(json.dumps(result, indent=1))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
