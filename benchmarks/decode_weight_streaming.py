"""How fast the CPU's int8 matmul kernels stream a decode step's weights (issue #26's floor).

A one-sequence decode step multiplies one row (or K + 1 rows when it verifies proposals) by every
weight of the model once, and the weights (134 MB of int8 for SmolLM2-135M) are far larger than
the CPU's caches: the step's matmul time is how fast a kernel reads them from memory. A single
layer timed on its own stays in cache (benchmarks/cpu_linear_kernels.py) and says nothing about
that. Here every layer of the model's shape gets its own random weights, so one pass over all of
them reads the whole set from memory, per kernel:

  _int_mm        Int8Linear without its one-row kernel (services/executor/quantized.py):
                 the row's quantization, torch._int_mm on int8 x int8, the dequantization
  onednn packed  torch.ops.onednn.qlinear_pointwise on weights prepacked for oneDNN, the same
                 int8 weights and the same activation levels (as uint8 with zero point 128),
                 fp32 out: the same sums, so it could replace _int_mm where it is faster
  fbgemm dynamic quantized::linear_dynamic on fbgemm-packed per-channel int8 weights: it
                 quantizes the activations itself (asymmetric, one scale per call), so its
                 outputs differ from the int8 path's, and with several rows a row's depends on
                 the others
  fbgemm rows    the same kernel as Int8Linear runs it for several rows (fbgemm_rows): each
                 row divided by its max |x|, a guard row fixing the call's range, scaled back:
                 the int8 path's levels per row, whatever the other rows
  fp32 linear    F.linear on fp32 weights of the same shapes: four times the bytes
  row kernels int8  the CPU row kernels' own (kernels/csrc/int8_rows.cpp; where they build):
                 each row on its own asymmetric levels, each weight tile read once per call
  row kernels int4  their 4-bit linear (kernels/csrc/int4_rows.cpp) on the same weights in
                 GGUF Q4_1's form (4 bits, fp16 scale and minimum per 32 inputs: 0.625 bytes a
                 weight); its GB/s count those bytes, its differences include the 4-bit weights'
  read floor     a max over the int8 weights' bytes (as int64 words): reading them and nothing else

Prints ms per pass and GB/s of weights read, and how far each kernel's outputs are from the
_int_mm path's (relative to the outputs' scale) on Gaussian rows and on a constant positive row
(the worst case for a kernel that sums pairs of u8 x s8 products in int16, as AVX2's
vpmaddubsw does: it saturates), then writes JSON. The kernels choose their instructions at run
time (the JSON names the capability torch saw and any variables set to limit it), so the
figures belong to the CPU they ran on.

    .venv/bin/python benchmarks/decode_weight_streaming.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kernels.cpu_rows import load_row_ops
from services.executor.quantized import (
    Int4Linear,
    Int8Linear,
    fbgemm_rows,
    pack_for_fbgemm,
    pack_int8_rows,
    quantize_rows,
)


def layer_shapes(args) -> list[tuple[int, int]]:
    """(in, out) of every linear of one decode step: q/k/v, o, gate/up, down per layer, the head."""
    hidden, inter = args.hidden, args.intermediate
    qkv = args.heads * args.head_dim + 2 * args.kv_heads * args.head_dim
    per_layer = [(hidden, qkv), (args.heads * args.head_dim, hidden), (hidden, 2 * inter)]
    per_layer.append((inter, hidden))
    return per_layer * args.layers + [(hidden, args.vocab)]


class Int8Layer:
    """One linear's int8 weights (per output channel), in every kernel's layout."""

    def __init__(self, k: int, n: int, generator: torch.Generator) -> None:
        self.k, self.n = k, n
        weight = torch.randn(n, k, generator=generator) * 0.02  # [out, in] fp32
        # The int8 path's own layer, its one-row kernel left out: _int_mm at every row count.
        self.int8 = Int8Linear(weight, None, decode_kernel=False)
        self.scales = self.int8.scales  # [out]
        self.q = self.int8.qweight_t.t().contiguous()  # [out, in] int8
        self.onednn = torch.ops.onednn.qlinear_prepack(self.q, None)
        self.fbgemm = pack_for_fbgemm(self.q, self.scales, None)
        self.fp32 = self.q.float() * self.scales[:, None]  # [out, in] the exact int8 weights
        self.rows_packed, self.rows_colsum = pack_int8_rows(self.q)
        self.int4 = Int4Linear.from_float(self.fp32, None)  # (packed for the row kernels below)


def run_int_mm(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
    return layer.int8(x)


def run_onednn(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:  # one row: one scale
    q, scales = quantize_rows(x)
    levels = q.to(torch.int16).add_(128).to(torch.uint8)  # the same levels, zero point 128
    zeros = torch.zeros(layer.n, dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(
        levels, scales.item(), 128, layer.onednn, layer.scales, zeros,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip


def run_fbgemm(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, layer.fbgemm, False)


def run_fbgemm_rows(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:
    return fbgemm_rows(x, layer.fbgemm)


def run_fp32(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.fp32)


def run_row_kernels(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:
    """The CPU row kernels' int8 linear (kernels/csrc/int8_rows.cpp): each row on its own
    asymmetric levels, each weight tile read once per call."""
    return ROW_OPS.int8_rows_linear(x, layer.rows_packed, layer.rows_colsum, layer.scales)


def run_row_kernels_int4(layer: Int8Layer, x: torch.Tensor) -> torch.Tensor:
    return layer.int4(x)


ROW_OPS = load_row_ops()
KERNELS = {
    "_int_mm": run_int_mm,
    "onednn packed": run_onednn,
    "fbgemm dynamic": run_fbgemm,
    "fbgemm rows": run_fbgemm_rows,
    "fp32 linear": run_fp32,
}
if ROW_OPS is not None:  # (not built here: the other kernels still run)
    KERNELS["row kernels int8"] = run_row_kernels
    KERNELS["row kernels int4"] = run_row_kernels_int4
# Bytes per weight each kernel reads (fp32 four, Q4_1 0.625), for its GB/s.
WEIGHT_BYTES = {"fp32 linear": 4.0, "row kernels int4": 0.625}


def one_pass(layers: list[Int8Layer], kernel, rows: int) -> float:
    """Seconds for one pass of `rows` activation rows through every layer."""
    xs = {k: torch.randn(rows, k) for k in {layer.k for layer in layers}}
    start = time.perf_counter()
    for layer in layers:
        kernel(layer, xs[layer.k])
    return time.perf_counter() - start


def read_floor(words: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in words:
        w.max()  # an integer max: no denormal slow path, vectorised (a sum of int32 is not)
    return time.perf_counter() - start


def max_relative_error(layers: list[Int8Layer], kernel, rows: int, constant: bool) -> float:
    """Largest |kernel - _int_mm| over a few layers' outputs, relative to _int_mm's max |out|;
    on Gaussian rows, or on rows of one positive value (every activation at the top level)."""
    worst = 0.0
    generator = torch.Generator().manual_seed(1)
    for layer in layers[:4]:
        x = torch.randn(rows, layer.k, generator=generator)
        if constant:
            x = torch.ones_like(x)
        reference = run_int_mm(layer, x)
        diff = (kernel(layer, x) - reference).abs().max() / reference.abs().max()
        worst = max(worst, diff.item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # SmolLM2-135M-Instruct, the embedded model.
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument(
        "--rows", default="1,2,4,8,16,32,64,128,256", help="activation rows per pass"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--json", default="benchmarks/results/decode_weight_streaming.json")
    parser.add_argument(
        "--kernels", default=None, help="comma-separated names to time (default: all of them)"
    )
    args = parser.parse_args()
    if args.kernels:
        for name in set(KERNELS) - set(args.kernels.split(",")):
            del KERNELS[name]
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    layers = [Int8Layer(k, n, generator) for k, n in layer_shapes(args)]
    int8_bytes = sum(layer.k * layer.n for layer in layers)
    words = [layer.q.view(torch.int64) for layer in layers]
    print(f"{len(layers)} linears, {int8_bytes / 1e6:.1f} MB of int8 weights", flush=True)
    for layer in layers:
        layer.int4.use_row_ops(ROW_OPS)
    for layer in layers:  # first touch of every layout, before any timing
        for kernel in KERNELS.values():
            kernel(layer, torch.randn(1, layer.k))
    rows_list = [int(r) for r in args.rows.split(",")]
    times: dict[str, list[float]] = {}
    for _ in range(args.passes):  # kernels alternate within each pass: the same machine load
        times.setdefault("read floor", []).append(read_floor(words))
        for rows in rows_list:
            for name, kernel in KERNELS.items():
                if name == "onednn packed" and rows > 1:
                    continue  # one activation scale per call: exact only for one row
                times.setdefault(f"{name}, {rows} row(s)", []).append(
                    one_pass(layers, kernel, rows)
                )
    results = {}
    for label, seconds in times.items():
        ms = statistics.median(seconds) * 1e3
        name, _, rows = label.partition(", ")
        weight_bytes = int8_bytes * WEIGHT_BYTES.get(name, 1.0)
        entry = {"ms": round(ms, 2), "gb_per_s": round(weight_bytes / ms / 1e6, 1)}
        if name in KERNELS and name != "_int_mm":
            rows_n = int(rows.split()[0])
            for constant, key in ((False, "gaussian"), (True, "constant_row")):
                entry[f"max_relative_diff_vs_int_mm_{key}"] = max_relative_error(
                    layers, KERNELS[name], rows_n, constant
                )
        results[label] = entry
        diffs = "  ".join(f"{k[28:]} {v:.1e}" for k, v in entry.items() if k.startswith("max_rel"))
        speed = f"{entry['ms']:8.2f} ms {entry['gb_per_s']:6.1f} GB/s"
        print(f"{label:26s} {speed}  {diffs}", flush=True)
    report = {
        "command": "benchmarks/decode_weight_streaming.py " + " ".join(sys.argv[1:]),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads,
        "isa_env": {
            name: os.environ.get(name)
            for name in ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
        },
        "load_avg_1m": os.getloadavg()[0],
        "int8_weight_mb": round(int8_bytes / 1e6, 1),
        "passes": args.passes,
        "median_per_pass": results,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
