"""The host's cost of calling each Triton kernel's Python wrapper, per call, on a CPU.

A step that is not replayed from a CUDA graph (a prompt chunk beside decodes, a batch larger
than the biggest graph, speculative verification) calls the attention wrappers once per layer
and the sampler's once per step; each call's host time (argument checks, tile choices, Triton's
argument binding, specialisation and cache lookup) is time the GPU may wait for. This times
the wrappers with Triton believing the current device is an sm_90 GPU and every launch turned
into a compile-only warm-up (as `scripts/compile_for_gpu.py` does): the kernels compile once,
then each call does all of its host work except the driver's launch itself (a few
microseconds on a GPU host), which this machine cannot make.

    .venv/bin/python benchmarks/triton_launch_overhead.py --compare-ref HEAD~1 \\
        --json benchmarks/results/triton_launch_overhead.json

With --compare-ref the same measurement runs on that git revision too (a worktree), rounds
alternated, so the two see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> dict:
    """Runs in the checkout under test (PYTHONPATH, set by run()); prints one JSON line of
    microseconds per call for each wrapper, the best of --repeats."""
    import os

    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
    import torch
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from scripts.compile_for_gpu import CompileOnlyDriver

    # compile_only() would also read each variant's resources at every launch: the driver
    # alone, and a warm-up per launch without that.
    driver.set_active(CompileOnlyDriver(90))
    run = JITFunction.run

    def warm(self, *call_args, grid, warmup, **kwargs):
        return run(self, *call_args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warm
    torch.set_num_threads(1)
    from kernels.triton_cache import store_kv
    from kernels.triton_decode import paged_decode_attention
    from kernels.triton_prefill import paged_prefill_attention
    from kernels.triton_sampling import gumbel_argmax

    dtype, rows, vocab = torch.bfloat16, 256, 49152
    calls = {}
    # Head layouts of the benchmark shapes: 1.1B (32 query heads over 4, 64 dims) and 8B (32
    # over 8, 128 dims); a 16-token block pool.
    for shape, kv_heads, head_dim in (("1b", 4, 64), ("8b", 8, 128)):
        k_cache = torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        query = torch.zeros(rows, 32, head_dim, dtype=dtype)
        table = torch.zeros(rows, 8, dtype=torch.int64)
        lens = torch.full((rows,), 100, dtype=torch.int64)
        scale = head_dim**-0.5
        calls[f"decode {shape}, {rows} rows"] = partial(
            paged_decode_attention, query, k_cache, v_cache, table, lens, scale
        )
        # One long context: split-K, the merge kernel's launch too.
        long_table, long_len = torch.zeros(1, 64, dtype=torch.int64), torch.tensor([1000])
        calls[f"decode {shape}, 1 row, split"] = partial(
            paged_decode_attention, query[:1], k_cache, v_cache, long_table, long_len, scale
        )
        chunk = torch.zeros(600, 32, head_dim, dtype=dtype)  # chunks of 512 and 88 tokens
        starts, chunk_lens = torch.tensor([0, 512, 600]), torch.tensor([512, 600])
        chunk_table = torch.zeros(2, 40, dtype=torch.int64)
        calls[f"prefill {shape}, 2 chunks"] = partial(
            paged_prefill_attention, chunk, k_cache, v_cache, chunk_table, starts, chunk_lens,
            scale, 512,
        )  # fmt: skip
        key = torch.zeros(rows, kv_heads, head_dim, dtype=dtype)
        calls[f"store_kv {shape}, {rows} rows"] = partial(
            store_kv, key, key, k_cache, v_cache, torch.arange(rows)
        )
    logits = torch.zeros(rows, vocab)
    temperature, keys = torch.ones(rows), torch.zeros(rows, dtype=torch.int64)
    top_p = torch.full((rows,), 0.9)
    calls[f"sampler {rows} rows"] = partial(gumbel_argmax, logits, temperature, keys)
    calls[f"sampler {rows} rows, top-p"] = partial(
        gumbel_argmax, logits, temperature, keys, top_p=top_p
    )
    out = {"triton": triton.__version__, "us_per_call": {}}
    for name, call in calls.items():
        call()  # compiles
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            best = min(best, (time.perf_counter() - start) / args.calls)
        out["us_per_call"][name] = best * 1e6
    return out


def run(root: Path, args) -> dict:
    from services.bench.ref_worktree import run_worker

    argv = ["--calls", str(args.calls), "--repeats", str(args.repeats)]
    return run_worker(Path(__file__).resolve(), root, argv, {"OMP_NUM_THREADS": "1"})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-ref", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from services.bench.ref_worktree import alternated_rounds

    runs = alternated_rounds(
        ROOT, args.compare_ref, "pagedserve-launch-ref-", args.rounds,
        lambda root: run(root, args),
        lambda label, _: print(f"{label}: round done", flush=True),
    )  # fmt: skip
    names = list(runs["current"][0]["us_per_call"])
    best = {
        label: {n: min(r["us_per_call"][n] for r in rs) for n in names}
        for label, rs in runs.items()
    }
    report = {
        "command": " ".join(["benchmarks/triton_launch_overhead.py", *sys.argv[1:]]),
        "triton": runs["current"][0]["triton"],
        "runs": runs,
        "best_us": best,
    }
    if args.compare_ref:
        # Each round's ratio, then their median: the machine's speed drifts between rounds.
        report["median_ratio"] = {
            n: statistics.median(
                cur["us_per_call"][n] / ref["us_per_call"][n]
                for cur, ref in zip(runs["current"], runs[args.compare_ref])
            )
            for n in names
        }
    for n in names:
        line = f"{n:34s} {best['current'][n]:7.1f} us"
        if args.compare_ref:
            line += f"  (at {args.compare_ref}: {best[args.compare_ref][n]:7.1f} us,"
            line += f" median ratio {report['median_ratio'][n]:.2f})"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
