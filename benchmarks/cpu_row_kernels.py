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

import statistics
import time

from services.bench.decode_steps import parse_args, prefilled_engine, write_report


def measure(args, batch: int) -> dict:
    engine = prefilled_engine(args.model, args.quantization, batch, args.prompt_len)
    model = engine.executor.model
    kernels = model.row_ops
    if kernels is None:
        raise SystemExit("the row kernels do not serve this model here (build or layers)")
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
    args = parse_args(__doc__, "1,4,16,64", 60, "benchmarks/results/cpu_row_kernels.json")
    rows = [measure(args, int(b)) for b in args.batch_sizes.split(",")]
    write_report("cpu_row_kernels.py", args, rows)


if __name__ == "__main__":
    main()
