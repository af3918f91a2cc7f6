"""Decode steps with the row kernels' int8 linear against fbgemm's, in one engine, step by step.

.venv/bin/python benchmarks/int8_rows_linear.py      # the embedded model, int8, two threads

One in-process engine per batch size (the CPU row kernels on); its sequences decode while every
step alternates between the int8 linears of few rows: the row kernels' own
(kernels/csrc/int8_rows.cpp, each row on its own levels, each weight tile read once per call)
and what the layer runs without it, the previous default: fbgemm's dynamic linear (one row
alone, several rows through the guarded call) where it sums exactly (VNNI), `_int_mm`
elsewhere. Both see the same contexts and the same machine state. Prints and writes the median
step time of each and their ratio; a step of b sequences is a call of b rows per linear (as a
verify step of b / (K + 1) sequences is).
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
from services.executor.quantized import Int8Linear, exact_decode_kernel, pack_for_fbgemm
from shared.config import EngineConfig, ModelConfig
from shared.sampling import SamplingParams


def measure(args, batch: int) -> dict:
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=args.model, quantization=args.quantization))
    )
    layers = [m for m in engine.executor.model.modules() if isinstance(m, Int8Linear)]
    packed = {m: m.rows_packed for m in layers}
    if not layers or any(p is None for p in packed.values()):
        raise SystemExit("needs int8 layers and the CPU row kernels (kernels/cpu_rows.py)")
    # The layers drop fbgemm's copy once they have the row kernels' one: packed back here.
    baseline = "fbgemm" if exact_decode_kernel() else "_int_mm"
    fbgemm = {
        m: pack_for_fbgemm(m.qweight_t.t(), m.scales, None) if baseline == "fbgemm" else None
        for m in layers
    }
    rng = random.Random(0)
    vocab = engine.executor.model.spec.vocab_size
    sampling = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, vocab) for _ in range(args.prompt_len)], sampling)
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for g in engine.scheduler.running for s in g.seqs
    ):
        engine.step()  # prefill everything first
    for _ in range(args.warmup):
        engine.step()
    times = {"int8_rows": [], "baseline": []}
    for _ in range(args.steps):
        for name in times:
            for m in layers:
                m.rows_packed = packed[m] if name == "int8_rows" else None
                m.few_rows = None if name == "int8_rows" else fbgemm[m]
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1000)
    for m in layers:
        m.rows_packed, m.few_rows = packed[m], None
    rows_ms, base_ms = statistics.median(times["int8_rows"]), statistics.median(times["baseline"])
    row = {
        "batch": batch,
        "context_after": args.prompt_len + args.warmup + 2 * args.steps,
        "baseline": baseline,
        "int8_rows_ms": rows_ms,
        "baseline_ms": base_ms,
        "int8_rows_over_baseline": rows_ms / base_ms,
        "steps_each": args.steps,
    }
    print(
        f"batch {batch:3d}: int8 rows {rows_ms:7.2f} ms, {baseline} {base_ms:7.2f} ms, "
        f"ratio {row['int8_rows_over_baseline']:.3f}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each kernel")
    parser.add_argument("--json", default="benchmarks/results/int8_rows_linear.json")
    args = parser.parse_args()
    rows = [measure(args, int(b)) for b in args.batch_sizes.split(",")]
    result = {
        "command": "benchmarks/int8_rows_linear.py " + " ".join(sys.argv[1:]),
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
