"""The sampler's draw on a device: the torch path (a sort of the vocabulary for top-p, the noise
as [rows, vocab] tensors) against the fused Triton kernel (kernels/triton_sampling.py), side by
side on the same logits, with the number of rows whose tokens differ.

Workloads: temperature 1 alone; top-p 0.9; top-k 50; top-k 50 with top-p 0.95; min-p 0.1 with
top-p 0.9. On CUDA each is timed with CUDA events (median of --reps after a warm-up); on a CPU
only a small smoke run makes sense (the kernel runs under TRITON_INTERPRET=1, interpreted).
Writes JSON.

    python benchmarks/sampling_kernel.py --vocabs 49152,128256 --json /tmp/sampling_kernel.json
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/sampling_kernel.py --device cpu --batch 4 \\
        --vocabs 300 --reps 1 --json /tmp/s.json   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

WORKLOADS = {
    "temperature": dict(),
    "top_p_0.9": dict(top_p=0.9),
    "top_k_50": dict(top_k=50),
    "top_k_50_top_p_0.95": dict(top_k=50, top_p=0.95),
    "min_p_0.1_top_p_0.9": dict(min_p=0.1, top_p=0.9),
}


def make_batch(rows: int, vocab: int, device: torch.device, top_k=0, top_p=1.0, min_p=0.0):
    from services.executor.counter_rng import position_key, sample_key
    from services.executor.sampler import SamplingBatch

    on = dict(device=device)
    return SamplingBatch(
        logits_rows=torch.arange(rows, **on),
        rows_identity=True,
        temperature=torch.ones(rows, **on),
        top_k=torch.full((rows,), top_k if 0 < top_k < vocab else vocab, **on),
        max_top_k=top_k or 1,
        top_p=torch.full((rows,), top_p if top_p < 1.0 else float("inf"), **on),
        min_p=torch.full((rows,), min_p, **on),
        rng_keys=torch.tensor([position_key(sample_key(s, 0), 1) for s in range(rows)], **on),
        all_greedy=False,
        use_top_k=0 < top_k < vocab,
        use_top_p=top_p < 1.0,
        use_min_p=min_p > 0.0,
        num_logprobs=-1,
    )


def time_ms(run, device: torch.device, reps: int) -> float:
    """Median milliseconds of run() (after one warm-up call that compiles)."""
    run()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(rows: int, vocab: int, options: dict, device: torch.device, reps: int) -> dict:
    from services.executor.sampler import _draw

    gen = torch.Generator().manual_seed(vocab)
    # Logits with a model's spread: a few likely tokens, a long tail.
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(device)
    batch = make_batch(rows, vocab, device, **options)
    torch_ids, _ = _draw(logits.clone(), batch, vocab, fused=False)
    fused_ids, _ = _draw(logits.clone(), batch, vocab, fused=True)
    torch_ms = time_ms(lambda: _draw(logits, batch, vocab, fused=False), device, reps)
    fused_ms = time_ms(lambda: _draw(logits, batch, vocab, fused=True), device, reps)
    return {
        "rows": rows,
        "vocab": vocab,
        "torch_ms": torch_ms,
        "fused_ms": fused_ms,
        "torch_over_fused": torch_ms / fused_ms,
        "rows_differing": int((torch_ids != fused_ids).sum()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocabs", default="49152,128256")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured")
        return 1
    results = []
    for vocab in map(int, args.vocabs.split(",")):
        for name, options in WORKLOADS.items():
            row = {"workload": name, **measure(args.batch, vocab, options, device, args.reps)}
            results.append(row)
            print(
                f"{name:>22} vocab {vocab:>6}: torch {row['torch_ms']:8.3f} ms  fused "
                f"{row['fused_ms']:8.3f} ms  ({row['torch_over_fused']:.2f}x)  rows differing "
                f"{row['rows_differing']}/{args.batch}",
                flush=True,
            )
    report = {
        "command": " ".join(["benchmarks/sampling_kernel.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
