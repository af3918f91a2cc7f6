"""The executor's host work per decode step at batch 256: what the device waits for between steps.

Runs the in-process engine on a random "tiny" Llama (hidden 64, 2 layers, vocabulary 384) on
the CPU with one torch thread, so that the forward pass is small and the executor's own Python
shows: filling in the pending inputs of an async-scheduled plan, applying the plan (block
tables, sampling state), building the step's inputs and the sampling batch, and turning the
sampled ids into result records. Host work per decode-only step = launch()'s wall time less
its forward and sampling phases + collect()'s wall time, medians over the decode steps. On a
CPU it includes the reference backend's own views (padded decode gathers, context mirrors),
which a GPU step does not build. Greedy and seeded random sampling (temperature 1, top-p 0.9)
are separate workloads. With --host-only the decode steps skip the model (zeros for its
output), so that the CPU's caches hold what the host work reads, as on a GPU host; without it
the CPU forward pass runs between two steps' host work and evicts it.

    .venv/bin/python benchmarks/executor_host_cost.py --compare-ref HEAD~1 [--host-only] \\
        --json benchmarks/results/executor_host_cost.json

With --compare-ref the same measurement runs on that git revision too (a worktree), rounds
alternated, so the two see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The host work's two parts (see worker()), then the executor's own phase marks inside them.
HOST_PHASES = ("launch_host", "collect_host", "cache_ops", "prepare")


def worker(args) -> dict:
    """Runs in the checkout under test (PYTHONPATH, set by run()); prints one JSON line of
    per-phase medians in ms."""
    import random

    import torch

    torch.set_num_threads(1)
    import services
    from services.engine.llm_engine import LLMEngine
    from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
    from shared.sampling import SamplingParams

    model_dir = args.model_dir
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), device="cpu", dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=int(0.2 * GiB)),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192),
    )
    # Async scheduling as on a GPU: decode plans name the previous step's samples as pending
    # inputs, which the executor fills in (part of its host work) before launching.
    engine = LLMEngine(config, overlap_steps=not args.no_overlap)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(args.input_len)] for _ in range(args.batch)]
    executor = engine.executor
    timings: list[dict[str, float]] = []

    def decode_only(plan) -> bool:
        return len(plan.seqs) == args.batch and plan.num_tokens == args.batch

    if args.host_only:
        # On a GPU host the CPU does not run the model between two steps' host work; here it
        # would, and its pass over the weights and the KV cache evicts what the host work
        # reads from the CPU's caches. A decode step at the measured batch gets zeros for
        # its hidden states instead (the same shapes; the samples then carry no meaning).
        model = executor.model
        real_forward = model.forward

        def forward(input_ids, positions, kv_cache, meta):
            if input_ids.shape[0] != args.batch or meta.max_query_len != 1:
                return real_forward(input_ids, positions, kv_cache, meta)
            return torch.zeros(input_ids.shape[0], model.spec.hidden_size)

        model.forward = forward
    # Timed from outside, so that every revision is measured alike: host work is the wall time
    # of launch() less its device phases (the forward pass and the sampler, which a GPU runs
    # asynchronously), plus the wall time of collect() (turning the samples into records).
    launch, collect = executor.launch, executor.collect
    decode_steps: dict[int, float] = {}

    def recording_launch(plan):
        start = time.perf_counter()
        flight = launch(plan)
        if decode_only(plan):
            decode_steps[plan.step_id] = time.perf_counter() - start
        return flight

    def recording_collect(flight):
        start = time.perf_counter()
        result = collect(flight)
        wall = time.perf_counter() - start
        launch_wall = decode_steps.pop(result.step_id, None)
        if launch_wall is not None:  # a result collected again later is counted once
            phases = dict(result.timings)
            device = phases.get("forward", 0.0) + phases.get("sample", 0.0)
            phases["launch_host"] = launch_wall - device
            phases["collect_host"] = wall
            phases["host"] = launch_wall - device + wall
            timings.append(phases)
        return result

    executor.launch, executor.collect = recording_launch, recording_collect
    out = {"code": str(Path(services.__file__).resolve().parents[1])}
    for name, sampling in (
        ("greedy", SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)),
        (
            "seeded_top_p",
            SamplingParams(
                max_tokens=args.output_len, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
            ),
        ),
    ):
        engine.generate(prompts, replace(sampling, max_tokens=4))  # warm-up, the same shapes
        timings.clear()
        engine.generate(prompts, sampling)
        phases = {p: statistics.median(t[p] for t in timings) * 1e3 for p in timings[0]}
        phases["steps"] = len(timings)
        out[name] = phases
    return out


def run(root: Path, args) -> dict:
    from services.bench.ref_worktree import run_worker

    argv = ["--model-dir", args.model_dir, "--batch", str(args.batch)]
    argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    argv += ["--no-overlap"] if args.no_overlap else []
    argv += ["--host-only"] if args.host_only else []
    return run_worker(Path(__file__).resolve(), root, argv, {"OMP_NUM_THREADS": "1"})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="decode steps at the batch size skip the model (zeros): host work alone",
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="plans without pending inputs (sync scheduling)"
    )
    parser.add_argument("--compare-ref", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    # Built here, once: the workers must import nothing but the checkout under test.
    import torch

    from services.bench.random_models import build_model
    from services.bench.ref_worktree import ref_worktree
    from shared.model_source import resolve_model

    work = Path(tempfile.mkdtemp(prefix="pagedserve-host-cost-"))
    args.model_dir = str(build_model("tiny", "cpu", torch.float32, resolve_model(None), work / "m"))
    roots = {"current": ROOT}
    with ref_worktree(ROOT, args.compare_ref, "pagedserve-host-ref-") as tree:
        if tree is not None:
            roots[args.compare_ref] = tree
        runs: dict[str, list[dict]] = {label: [] for label in roots}
        for _ in range(args.rounds):
            for label, root in roots.items():
                runs[label].append(run(root, args))
                summary = {
                    w: f"host {r['host']:.2f} ms (forward {r['forward']:.2f})"
                    for w, r in runs[label][-1].items()
                    if w != "code"
                }
                print(f"{label}: {summary}", flush=True)
    best = {
        label: {w: {p: min(r[w][p] for r in rs) for p in rs[0][w]} for w in rs[0] if w != "code"}
        for label, rs in runs.items()
    }
    report = {
        "command": " ".join(["benchmarks/executor_host_cost.py", *sys.argv[1:]]),
        "batch": args.batch,
        "runs": runs,
        "best_ms": best,
    }
    for label, by_workload in best.items():
        for w, phases in by_workload.items():
            split = ", ".join(f"{p} {phases[p]:.2f}" for p in HOST_PHASES if p in phases)
            print(f"{label} {w}: host {phases['host']:.2f} ms per decode step ({split})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
