"""The scheduler's host work per decode step at batch 256: planning and applying results.

On a GPU the 1.1B shape's steps wait on the host (docs/benchmarks.md, "GPU: first measurements
on an H200"), and the scheduler is a large part of it. This runs the in-process engine with the
simulated executor (no model: every step's result comes back at once, so nothing but the
scheduler and the engine's loop costs time) and times, per decode step at the full batch, the
plan (schedule_ahead() with async scheduling, schedule() without), update() (applying the
sampled tokens), and the whole engine step: medians over the decode steps, and the longest step
and the whole run (where the garbage collector's full passes show), best of alternated rounds;
--compare-ref runs a git revision the same way, in the same rounds.

The served scheduler process also encodes each plan for the executor (plan_wire), decodes each
result (result_wire), and builds and encodes the step's deltas for the gateway (deltas, as the
service sends them at the revision measured): those are timed here too, on the same plans,
results and updates, and count in the step's time.

    .venv/bin/python benchmarks/scheduler_host_cost.py --compare-ref HEAD~1 \\
        --json benchmarks/results/scheduler_host_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("plan", "plan_wire", "update", "result_wire", "deltas", "step")


def worker(args) -> dict:
    """Runs in the checkout under test (PYTHONPATH, set by run()); returns per-phase medians
    in ms for each scheduling mode."""
    import random

    from services.engine.llm_engine import LLMEngine
    from services.scheduler import outputs
    from services.scheduler.scheduler import Scheduler
    from shared import wire
    from shared.config import EngineConfig, SchedulerConfig, SimConfig
    from shared.protocol import SchedulerStats, TokenDeltas
    from shared.sampling import SamplingParams

    timings: dict[str, float] = {}

    def timed(name: str, call):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

        return run

    def served(call, phase: str, wire_work):
        """call timed as `phase`, then what the served scheduler does with its outcome."""
        timed_call = timed(phase, call)

        def run(*a, **k):
            out = timed_call(*a, **k)
            wire_work(a[1:], out)
            return out

        return run

    def plan_wire(_, plan) -> None:
        if plan is not None:
            timed("plan_wire", wire.encode)(plan)

    stats = SchedulerStats(0, 0, 0, 0, 0, 0, 0)

    def result_and_deltas(args, updates) -> None:
        (result,) = args
        timed("result_wire", wire.decode)(wire.encode(result))  # the executor encodes it

        def deltas():
            if hasattr(outputs, "step_deltas"):  # as the service sends them
                records, next_tokens = outputs.step_deltas(updates)
                return wire.encode(TokenDeltas(records, stats, next_tokens))
            # A revision from before the plain one-token columns: a record per update.
            return wire.encode(TokenDeltas([outputs.group_delta(u) for u in updates], stats))

        timed("deltas", deltas)()

    Scheduler.schedule = served(Scheduler.schedule, "plan", plan_wire)
    Scheduler.schedule_ahead = served(Scheduler.schedule_ahead, "plan", plan_wire)
    Scheduler.update = served(Scheduler.update, "update", result_and_deltas)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.input_len)] for _ in range(args.batch)]
    out = {}
    for mode, overlap in (("async", True), ("sync", False)):
        config = EngineConfig(
            executor="sim",
            sim=SimConfig(gpu="a100-80gb", model="llama-7b"),
            scheduler=SchedulerConfig(
                max_num_seqs=args.batch, max_num_batched_tokens=8192, async_scheduling=overlap
            ),
        )
        engine = LLMEngine(config, overlap_steps=overlap)
        sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        steps: list[dict[str, float]] = []
        last = [time.perf_counter()]

        def on_step(e, steps=steps, last=last) -> None:
            now = time.perf_counter()
            if e.scheduler.num_running_seqs == args.batch and not e.scheduler.waiting:
                steps.append({**timings, "step": now - last[0]})
            timings.clear()
            last[0] = time.perf_counter()

        engine.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        timings.clear()
        last[0] = start = time.perf_counter()
        engine.generate(prompts, [sampling] * len(prompts), on_step=on_step)
        total = time.perf_counter() - start
        steps = steps[2:]  # the first steps at full batch still carry the prompts' last chunks
        out[mode] = {p: 1e3 * statistics.median(s.get(p, 0.0) for s in steps) for p in PHASES}
        out[mode]["steps"] = len(steps)
        # The collector's full passes land in a few steps: medians hide them, these do not.
        out[mode]["step_max"] = 1e3 * max(s["step"] for s in steps)
        out[mode]["total_s"] = total
        engine.close()  # before the next mode's engine: one engine alive at a time
    return out


def run(root: Path, args) -> dict:
    from services.bench.ref_worktree import run_worker

    argv = ["--batch", str(args.batch), "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len)]
    return run_worker(Path(__file__).resolve(), root, argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-ref", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from services.bench.ref_worktree import ref_worktree

    roots = {"current": ROOT}
    with ref_worktree(ROOT, args.compare_ref, "pagedserve-scheduler-ref-") as tree:
        if tree is not None:
            roots[args.compare_ref] = tree
        runs: dict[str, list[dict]] = {label: [] for label in roots}
        for _ in range(args.rounds):  # alternated, so that drift in the machine's load hits all
            for label, root in roots.items():
                runs[label].append(run(root, args))
                print(label, json.dumps(runs[label][-1]), flush=True)
    best = {
        label: {
            mode: {
                p: min(r[mode][p] for r in rs) for p in (*PHASES, "steps", "step_max", "total_s")
            }
            for mode in rs[0]
        }
        for label, rs in runs.items()
    }
    for label, by_mode in best.items():
        for mode, phases in by_mode.items():
            split = ", ".join(f"{p} {phases[p]:.2f}" for p in PHASES)
            print(f"{label} {mode}: ms per decode step at {args.batch}: {split}; longest step "
                  f"{phases['step_max']:.1f} ms, whole run {phases['total_s']:.2f} s")  # fmt: skip
    # This machine's speed drifts over minutes: the best of each side may come from different
    # minutes, while the two runs of one round are seconds apart. Each round's ratio, then
    # their median, compares like with like.
    ratios = {}
    if args.compare_ref:
        cur, ref = runs["current"], runs[args.compare_ref]
        for mode in cur[0]:
            ratios[mode] = {
                p: statistics.median(
                    c[mode][p] / r[mode][p] for c, r in zip(cur, ref) if r[mode][p] > 0
                )
                for p in (*PHASES, "step_max", "total_s")
                if any(r[mode][p] > 0 for r in ref)
            }
            split = ", ".join(f"{p} {v:.2f}x" for p, v in ratios[mode].items())
            print(f"current / {args.compare_ref} {mode}, median of the rounds' ratios: {split}")
    if args.json:
        report = {
            "command": " ".join(["benchmarks/scheduler_host_cost.py", *sys.argv[1:]]),
            "batch": args.batch,
            "runs": runs,
            "best_ms": best,
            "median_round_ratio": ratios,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
