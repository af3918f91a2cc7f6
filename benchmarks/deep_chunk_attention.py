"""What a prompt chunk deep in a long context costs in attention on the CPU: the part every chunk
pays once for reading the context, and the part each of its rows adds.

Times kernels.reference.paged_attention on one mirrored span (the path a deep chunk takes,
services/executor/context_mirror.py) for every layer of the model's shapes, over a grid of
query rows r and context lengths c, and fits t = c * (read + row * r) by least squares. The
ratio read / row is how many rows' worth of attention reading the context costs. At 7,800
tokens the read alone costs a chunk of one row more than a decode step of the model at batch 1:
the floor under the gaps of streams beside a long prompt, which no smaller chunk lowers (pricing
it into the chunks was measured and reverted, docs/benchmarks.md).

    .venv/bin/python benchmarks/deep_chunk_attention.py \\
        --json benchmarks/results/deep_chunk_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kernels.metadata import metadata_from_table
from kernels.reference import paged_attention
from shared.model_source import EMBEDDED_MODEL, resolve_model

BLOCK_SIZE = 16


def time_chunk(shape: dict, rows: int, context: int, repeats: int) -> float:
    """Median seconds of one step's attention, all layers, for a chunk of `rows` at `context`."""
    layers, kv_heads, heads, dim = shape["layers"], shape["kv_heads"], shape["heads"], shape["dim"]
    total = context + rows
    num_blocks = -(-total // BLOCK_SIZE)
    pool = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, dim)  # unread: the mirror serves
    mirror = torch.randn(layers, 2, kv_heads, total, dim)  # [L, 2, kv_heads, capacity, D]
    table = torch.arange(num_blocks, dtype=torch.int64)[None]  # [1, num_blocks]
    meta = metadata_from_table([rows], [context], table, BLOCK_SIZE, mirrors=[mirror])
    query = torch.randn(rows, heads, dim)  # [r, heads, D]
    new_kv = torch.randn(rows, kv_heads, dim)  # [r, kv_heads, D]
    scale = dim**-0.5

    def step() -> None:
        for layer in range(layers):
            paged_attention(query, pool, pool, meta, scale, new_kv, new_kv, layer=layer)

    step()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit(points: list[dict]) -> tuple[float, float]:
    """(read, row) seconds per context token in t = c * (read + row * r), least squares."""
    # t / c = read + row * r: a line in r.
    xs = [p["rows"] for p in points]
    ys = [p["seconds"] / p["context"] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    row = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - row * mean_x, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--contexts", default="2000,4000,7800")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((resolve_model(args.model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    shape = {
        "layers": config["num_hidden_layers"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads", heads),
        "dim": config.get("head_dim") or config["hidden_size"] // heads,
    }
    points = []
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            seconds = time_chunk(shape, rows, context, args.repeats)
            # Unrounded: on a fast CPU small timings rounded alike gave a slope of exactly 0.
            points.append({"rows": rows, "context": context, "seconds": seconds})
            print(f"context {context:5d} rows {rows:3d}: {seconds * 1e3:7.1f} ms", flush=True)
    read, row = fit(points)
    out = {
        "model": args.model,
        "shape": shape,
        "threads": args.threads,
        "points": points,
        "read_s_per_context_token": read,
        "row_s_per_context_token": row,
        # None when the fit finds no per-row cost (timings too small to tell rows apart).
        "context_read_rows": round(read / row, 2) if row > 0 else None,
    }
    print(f"fit: t = c * ({read * 1e9:.1f} + {row * 1e9:.1f} * r) ns; read = "
          f"{out['context_read_rows']} rows")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
