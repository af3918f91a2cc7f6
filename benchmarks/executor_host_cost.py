"""The executor's host work per decode step at batch 256: what the device waits for between steps.

Runs the in-process engine on a random "tiny" Llama (hidden 64, 2 layers, vocabulary 384) on
the CPU with one torch thread, so that the forward pass is small and the executor's own Python
shows: applying the plan (block tables, sampling state), building the step's inputs and the
sampling batch, and turning the sampled ids into result records. Each decode-only step's phase
times come from the executor's own PhaseTimer; reported as medians over the decode steps.
Greedy and seeded random sampling (temperature 1, top-p 0.9) are separate workloads.

    .venv/bin/python benchmarks/executor_host_cost.py --compare-ref HEAD~1 \\
        --json benchmarks/results/executor_host_cost.json

With --compare-ref the same measurement runs on that git revision too (a worktree), rounds
alternated, so the two see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# No device work in these on a CPU. "records" (the samples into result records) was part of
# "sync_out" until the executor could collect a step after launching the next one.
HOST_PHASES = ("cache_ops", "prepare", "sync_out", "records")


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
    engine = LLMEngine(config)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(args.input_len)] for _ in range(args.batch)]
    executor = engine.executor
    timings: list[dict[str, float]] = []

    def decode_only(plan) -> bool:
        return len(plan.seqs) == args.batch and plan.num_tokens == args.batch

    if hasattr(executor, "launch"):  # launch() and collect(): the step's timings at collect
        launch, collect = executor.launch, executor.collect
        decode_steps: set[int] = set()

        def recording_launch(plan):
            if decode_only(plan):
                decode_steps.add(plan.step_id)
            return launch(plan)

        def recording_collect(flight):
            result = collect(flight)
            if result.step_id in decode_steps:
                timings.append(result.timings)
            return result

        executor.launch, executor.collect = recording_launch, recording_collect
    else:  # earlier code: one _execute() per step
        execute = executor._execute

        def recording(plan):
            result = execute(plan)
            if decode_only(plan):
                timings.append(result.timings)
            return result

        executor._execute = recording
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
        phases["host"] = sum(phases.get(p, 0.0) for p in HOST_PHASES)
        phases["steps"] = len(timings)
        out[name] = phases
    return out


def run(root: Path, args) -> dict:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--model-dir",
        args.model_dir,
    ]
    argv += ["--batch", str(args.batch), "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-ref", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    # Built here, once: the workers must import nothing but the checkout under test.
    import torch

    from services.bench.random_models import build_model
    from shared.model_source import resolve_model

    work = Path(tempfile.mkdtemp(prefix="pagedserve-host-cost-"))
    args.model_dir = str(build_model("tiny", "cpu", torch.float32, resolve_model(None), work / "m"))
    roots = {"current": ROOT}
    worktree = None
    if args.compare_ref:
        worktree = Path(tempfile.mkdtemp(prefix="pagedserve-host-ref-")) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), args.compare_ref],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        roots[args.compare_ref] = worktree
    runs: dict[str, list[dict]] = {label: [] for label in roots}
    try:
        for _ in range(args.rounds):
            for label, root in roots.items():
                runs[label].append(run(root, args))
                summary = {
                    w: f"host {r['host']:.2f} ms (forward {r['forward']:.2f})"
                    for w, r in runs[label][-1].items()
                    if w != "code"
                }
                print(f"{label}: {summary}", flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT)
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
