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

import statistics
import time

from services.bench.decode_steps import parse_args, prefilled_engine, write_report
from services.executor.quantized import Int8Linear, exact_decode_kernel, pack_for_fbgemm


def measure(args, batch: int) -> dict:
    engine = prefilled_engine(args.model, args.quantization, batch, args.prompt_len)
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
    args = parse_args(__doc__, "1,4,8,16,32", 40, "benchmarks/results/int8_rows_linear.json")
    rows = [measure(args, int(b)) for b in args.batch_sizes.split(",")]
    write_report("int8_rows_linear.py", args, rows)


if __name__ == "__main__":
    main()
