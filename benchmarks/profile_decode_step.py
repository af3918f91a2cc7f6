"""Where a decode step's time goes: mean step time and the top torch ops, for N sequences.

.venv/bin/python benchmarks/profile_decode_step.py --num-seqs 64 --prompt-len 100

Writes the step time and the op table as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig, ModelConfig
from shared.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quantization", default="none", help="none (fp32), int8, int4, auto")
    parser.add_argument("--json", default="benchmarks/results/profile_decode_step.json")
    parser.add_argument(
        "--compiled-layers",
        action="store_true",
        help="each layer's dense parts through torch.compile (benchmarks/compiled_decode_step.py)",
    )
    args = parser.parse_args()
    if args.compiled_layers:
        import torch
        from compiled_decode_step import compiled_layer_forward  # this folder: sys.path[0]

        from services.executor.models.layers import DecoderLayer

        torch._dynamo.config.cache_size_limit = 64
        DecoderLayer.forward = compiled_layer_forward()  # compiled on the first steps below

    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=args.model, quantization=args.quantization))
    )
    rng = random.Random(0)
    vocab = engine.executor.model.spec.vocab_size
    sampling = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for _ in range(args.num_seqs):
        engine.add_request([rng.randrange(100, vocab) for _ in range(args.prompt_len)], sampling)
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for g in engine.scheduler.running for s in g.seqs
    ):
        engine.step()  # prefill everything first
    engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(
        f"{args.num_seqs} sequences, context ~{args.prompt_len + args.steps}: "
        f"{step_s * 1000:.0f} ms per decode step"
    )
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=12))
    total = sum(e.self_cpu_time_total for e in averages)
    ops = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:20]
    result = {
        "command": "benchmarks/profile_decode_step.py " + " ".join(sys.argv[1:]),
        "num_seqs": args.num_seqs,
        "context": args.prompt_len + args.steps,
        "ms_per_decode_step": step_s * 1000,
        "top_ops_self_cpu": [
            {
                "op": e.key,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1000 / args.steps,
                "fraction": e.self_cpu_time_total / total,
                "calls_per_step": e.count / args.steps,
            }
            for e in ops
        ],
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
