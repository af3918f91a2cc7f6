"""CPU linear-layer kernels side by side: fp32 GEMM against torch's int8 and int4 paths and
the CPU row kernels' int8 and 4-bit linears.

Why `--quantization int8` runs where it runs and int4 is not the default: times one
[M, 576] x [576, 3072] layer (SmolLM2-135M's gate/up shape) per kernel and batch size M,
including `Int8Linear` as the executor sets it up on this CPU (row kernels attached where
built; without a fast `_int_mm`, no VNNI, they take calls of every size).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kernels.cpu_rows import load_row_ops
from services.executor.quantized import Int4Linear, Int8Linear, int_mm_has_fast_path

K, N = 576, 3072


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (packing caches, first-touch)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def kernels(m: int) -> dict:
    """name -> zero-argument callable computing x [m, K] @ w^T [K, N] that way."""
    x = torch.randn(m, K)
    w = torch.randn(N, K)
    x8 = torch.randint(-127, 128, (m, K), dtype=torch.int8)
    w8t = torch.randint(-127, 128, (K, N), dtype=torch.int8)
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scales = torch.rand(N)
    group = 32
    w_int4 = torch.randint(0, 16, (N, K), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(w_int4, 2)
    scales_zeros = torch.rand(K // group, N, 2)
    layer = Int8Linear(w, None)
    layer.use_row_ops(load_row_ops())
    int4 = Int4Linear.from_float(w * 0.02, None)  # (Q4_1 blocks of the same shape)
    int4.use_row_ops(load_row_ops())
    rows = {}
    if layer.rows_packed is not None:
        rows["row kernels int8_rows_linear"] = lambda: layer.row_ops.int8_rows_linear(
            x, layer.rows_packed, layer.rows_colsum, layer.scales
        )
    if int4.rows_packed is not None:
        rows["row kernels int4_rows_linear"] = lambda: int4.row_ops.int4_rows_linear(
            x, int4.rows_packed
        )
    return {
        "fp32 mm": lambda: x @ w.T,
        "_int_mm int8 x int8": lambda: torch._int_mm(x8, w8t),
        "_weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, w8, scales),
        "_weight_int4pack_mm_for_cpu": lambda: torch._weight_int4pack_mm_for_cpu(
            x, packed, group, scales_zeros
        ),
        **rows,
        "Int8Linear (the executor's int8 layer)": lambda: layer(x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,2048", help="batch sizes M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/cpu_linear_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {
        "shape": [K, N],
        "threads": args.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "int_mm_fast_path": int_mm_has_fast_path(),
        "row_kernels": load_row_ops() is not None,
        "load": os.getloadavg(),
        "ms": {},
    }
    for m in (int(r) for r in args.rows.split(",")):
        row = {}
        for name, fn in kernels(m).items():
            row[name] = _time(fn, args.repeats if m < 1024 else max(1, args.repeats // 2))
            print(f"M={m:5d} {name:30s} {row[name]:9.2f} ms", flush=True)
        results["ms"][str(m)] = row
    results["load_after"] = os.getloadavg()
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
