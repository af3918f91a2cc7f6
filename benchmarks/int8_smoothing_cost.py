"""What SmoothQuant costs the int8 path per step: int8 before it and with it, side by side.

SmoothQuant's factors are folded into weights at load, so the int8 kernels run unchanged; this
measures that claim on the embedded model's real weights instead of assuming it. Per layer
(qkv, o, gate/up, down, LM head) at 1, 64 and 512 rows: `Int8Linear` of the plain weights
against `Int8Linear` of the smoothed ones. Per step: the whole model (a decode step of B
sequences at a 256-token context, and a 512-token prefill, each with the LM head on the rows
that sample) quantized without calibration (the int8 path before) and with it (today's).
Old and new alternate within each repeat, so load on the machine hits both alike; the
figure is the median. Also the load-time cost of the calibration pass.

    .venv/bin/python benchmarks/int8_smoothing_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kernels.metadata import build_attention_metadata
from kernels.ops import select_ops
from services.executor.model_setup import max_model_len
from services.executor.quantize_model import calibration_token_ids, quantize_model
from services.executor.quantized import Int8Linear
from services.executor.smoothing import ALPHA, HEAD, factors, head_weight, input_maxima
from services.executor.weights import load_model
from shared.model_source import resolve_model

BLOCK_SIZE = 16


def side_by_side(old, new, repeats: int) -> dict:
    """Median ms of two zero-argument callables, run alternately (one warm-up each)."""
    old(), new()
    times: dict[str, list[float]] = {"old_ms": [], "new_ms": []}
    for _ in range(repeats):
        for key, fn in (("old_ms", old), ("new_ms", new)):
            start = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - start) * 1e3)
    row = {key: statistics.median(values) for key, values in times.items()}
    row["new_over_old"] = row["new_ms"] / row["old_ms"]
    return row


def layer_rows(model, maxima: dict, rows: list[int], repeats: int) -> dict:
    """Layer 0's linears and the LM head, plain and smoothed, on random activations."""
    layer = model.layers[0]
    weights = {
        name: getattr(getattr(layer, name.split(".")[0]), name.split(".")[1]).weight.detach()
        for name in type(model).quantizable_modules
    }
    weights[HEAD] = head_weight(model)
    keys = {name: f"layers.0.{name}" for name in type(model).quantizable_modules} | {HEAD: HEAD}
    results = {}
    for name, weight in weights.items():
        s = factors(maxima[keys[name]], weight.abs().amax(dim=0), ALPHA)
        old, new = Int8Linear(weight, None), Int8Linear(weight * s, None)
        for m in rows:
            x = torch.randn(m, weight.shape[1])
            xs = x / s  # what the smoothed layer's input would be
            with torch.inference_mode():
                row = side_by_side(
                    lambda old=old, x=x: old(x), lambda new=new, xs=xs: new(xs), repeats
                )
            row["shape"] = list(weight.shape)
            results[f"{name} rows={m}"] = row
            print(f"{name:20s} rows={m:4d} {_fmt(row)}", flush=True)
    return results


def step_fn(model, num_seqs: int, query_len: int, context: int):
    """A forward of num_seqs sequences computing query_len tokens each after context - query_len
    cached ones, and the LM head on each sequence's last row."""
    layout = model.kv_layout
    blocks_per_seq = -(-context // BLOCK_SIZE)
    kv = torch.zeros(
        layout.num_layers,
        2,
        num_seqs * blocks_per_seq,
        BLOCK_SIZE,
        layout.num_kv_heads,
        layout.head_dim,
    )
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    meta = build_attention_metadata(
        [query_len] * num_seqs, [context - query_len] * num_seqs, tables, BLOCK_SIZE
    )
    ids = torch.randint(0, model.spec.vocab_size, (num_seqs * query_len,))
    last_rows = torch.arange(1, num_seqs + 1) * query_len - 1

    def run() -> None:
        with torch.inference_mode():
            hidden = model(ids, meta.positions, kv, meta)
            model.compute_logits(hidden[last_rows])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--rows", default="1,64,512", help="layer batch sizes")
    parser.add_argument("--decode-batches", default="1,16,64", help="sequences per decode step")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/int8_smoothing_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = resolve_model(args.model)
    from transformers import AutoConfig

    context = min(256, max_model_len(AutoConfig.from_pretrained(model_dir), None))
    ops = select_ops("torch", torch.device("cpu"))
    old = load_model(model_dir, torch.float32, 2 * context + args.prefill_len, ops, "cpu")
    new = load_model(model_dir, torch.float32, 2 * context + args.prefill_len, ops, "cpu")
    calibration = calibration_token_ids(model_dir, context + args.prefill_len)
    start = time.perf_counter()
    maxima = input_maxima(new, calibration, type(new).quantizable_modules)
    calibration_s = time.perf_counter() - start
    report = {
        "threads": args.threads,
        "load": os.getloadavg(),
        "calibration_tokens": len(calibration),
        "calibration_pass_s": round(calibration_s, 3),
        "layers": layer_rows(new, maxima, [int(r) for r in args.rows.split(",")], args.repeats),
    }
    quantize_model(old, "int8")
    quantize_model(new, "int8", calibration_ids=calibration)
    steps = {}
    cases = [(f"decode batch={b}", b, 1) for b in map(int, args.decode_batches.split(","))]
    cases.append((f"prefill {args.prefill_len}", 1, args.prefill_len))
    for name, num_seqs, query_len in cases:
        length = context if query_len == 1 else query_len
        row = side_by_side(
            step_fn(old, num_seqs, query_len, length),
            step_fn(new, num_seqs, query_len, length),
            args.repeats if query_len == 1 else max(2, args.repeats // 4),
        )
        steps[name] = row
        print(f"{name:26s} {_fmt(row)}", flush=True)
    report["steps"] = steps
    report["load_after"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def _fmt(row: dict) -> str:
    return f"old {row['old_ms']:8.3f} ms  new {row['new_ms']:8.3f} ms  x{row['new_over_old']:.3f}"


if __name__ == "__main__":
    main()
