"""fp32 GEMM rate of x @ W^T against W @ x^T for the model's linear shapes, on this CPU.

Decides `FLIPPED_ROWS` in services/executor/models/layers.py: the row count up to which the
executor computes linear layers as W @ x^T.

    .venv/bin/python benchmarks/linear_orientation.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def gflops(fn, flops: float, seconds: float) -> float:
    for _ in range(3):
        fn()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return flops * count / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--rows", default="1,16,64,256,1024,2048", help="batch rows to time")
    parser.add_argument("--output", default="benchmarks/results/linear_orientation.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # SmolLM2-135M: qkv, o, gate_up, down, lm_head (in_features, out_features)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
    results = []
    print(f"{'rows':>6} {'in':>6} {'out':>6} {'x@W^T':>8} {'W@x^T':>8} {'ratio':>6}  (GFLOP/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        for k, n in shapes:
            if n == 49152 and rows > 256:
                continue  # the LM head only sees sampling rows
            x, w = torch.randn(rows, k), torch.randn(n, k)
            flops = 2 * rows * k * n
            plain = gflops(lambda x=x, w=w: F.linear(x, w), flops, args.seconds)
            flipped = gflops(
                lambda x=x, w=w: torch.mm(w, x.t()).t().contiguous(), flops, args.seconds
            )
            results.append({"rows": rows, "in": k, "out": n, "x_wt": plain, "w_xt": flipped})
            print(f"{rows:>6} {k:>6} {n:>6} {plain:>8.1f} {flipped:>8.1f} {flipped / plain:>6.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    summary = {"threads": args.threads, "results": results}
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print("wrote", args.output)


if __name__ == "__main__":
    main()
