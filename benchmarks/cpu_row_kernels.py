"""Decode steps with the CPU row kernels against the reference ops, in one engine, step by step.

.venv/bin/python benchmarks/cpu_row_kernels.py      # the embedded model, int8, two threads

One in-process engine per batch size; its sequences decode while every step alternates between
the row kernels (kernels/cpu_rows.py) and the reference layers (the model's row_ops unset), so
both see the same contexts, the same machine state and the same noise. Prints and writes the
median step time of each and their ratio. Speed only: whether the outputs agree is the tests'
business (tests/engine/test_cpu_row_kernels.py), and with int8 weights the two paths' float
rounding differs enough for near-tie tokens to differ (docs/benchmarks.md, "Batch invariance").
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig, ModelConfig
from shared.sampling import SamplingParams


def measure(args, batch: int) -> dict:
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=args.model, quantization=args.quantization))
    )
    model = engine.executor.model
    kernels = model.row_ops
    if kernels is None:
        raise SystemExit("the row kernels do not serve this model here (build or layers)")
    rng = random.Random(0)
    vocab = model.spec.vocab_size
    sampling = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, vocab) for _ in range(args.prompt_len)], sampling)
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for g in engine.scheduler.running for s in g.seqs
    ):
        engine.step()  # prefill everything first
    times = {"kernels": [], "reference": []}
    for _ in range(args.warmup):
        engine.step()
    for _ in range(args.steps):
        for name, ops in (("kernels", kernels), ("reference", None)):
            model.row_ops = ops
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1000)
    model.row_ops = kernels
    kernels_ms = statistics.median(times["kernels"])
    reference_ms = statistics.median(times["reference"])
    row = {
        "batch": batch,
        "context_after": args.prompt_len + args.warmup + 2 * args.steps,
        "kernels_ms": kernels_ms,
        "reference_ms": reference_ms,
        "kernels_over_reference": kernels_ms / reference_ms,
        "steps_each": args.steps,
    }
    print(
        f"batch {batch:3d}: kernels {kernels_ms:7.2f} ms, reference {reference_ms:7.2f} ms, "
        f"ratio {row['kernels_over_reference']:.3f}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each path")
    parser.add_argument("--json", default="benchmarks/results/cpu_row_kernels.json")
    args = parser.parse_args()
    rows = [measure(args, int(b)) for b in args.batch_sizes.split(",")]
    result = {
        "command": "benchmarks/cpu_row_kernels.py " + " ".join(sys.argv[1:]),
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
