"""Where an in-process step's host time goes at batch 256: Python functions and device ops.

On an H200 the 1.1B shape's steps wait on the host (docs/benchmarks.md, "GPU: first
measurements on an H200"): the executor's launch() took 3.8-6.2 ms a decode step there against
0.5-0.8 ms of the same work on a CPU, and the scheduler and engine another 6.6-7.6 ms. This runs
the in-process engine (overlapped steps, as on CUDA by default) on a random Llama of a named
shape, twice over the same requests: once under cProfile (the host's Python, by function: self
and cumulative seconds) and once under torch.profiler (the ops the host launches, with their
counts and host and device times). Both tables are written to JSON, top rows only, with the
decode steps counted so per-step figures can be read off.

    python benchmarks/gpu_step_profile.py --shape 1b --tokenizer DIR --json /tmp/profile.json
    python benchmarks/gpu_step_profile.py --shape tiny --device cpu --dtype float32 \\
        --tokenizer DIR --num-requests 8 --output-len 4 --json /tmp/p.json   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.bench.random_models import SHAPES, add_random_run_args, build_model
from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def python_table(profile: cProfile.Profile, rows: int) -> dict[str, list[dict]]:
    """The top functions by self and by cumulative seconds."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    entries = []
    for (filename, line, name), (_, calls, self_s, cum_s, _) in stats.items():
        where = filename.removeprefix(str(ROOT) + "/")
        entries.append({"function": f"{where}:{line} {name}", "calls": calls,
                        "self_s": self_s, "cumulative_s": cum_s})  # fmt: skip
    return {
        "by_self": sorted(entries, key=lambda e: -e["self_s"])[:rows],
        "by_cumulative": sorted(entries, key=lambda e: -e["cumulative_s"])[:rows],
    }


def op_table(profiler, device: str, rows: int) -> list[dict]:
    """The top ops by the host's own time, with their counts and device time."""
    out = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        out.append({"op": event.key, "count": event.count,
                    "self_cpu_us": event.self_cpu_time_total,
                    "self_device_us": device_us if device == "cuda" else 0.0})  # fmt: skip
    return sorted(out, key=lambda e: -e["self_cpu_us"])[:rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_run_args(parser, output_len=64, kv_cache_gb=20.0)
    parser.add_argument("--rows", type=int, default=60, help="rows kept of each table")
    parser.add_argument("--json", default="benchmarks/results/gpu_step_profile.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pagedserve-step-profile-"))
    report: dict = {"command": " ".join(["benchmarks/gpu_step_profile.py", *sys.argv[1:]]),
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__}  # fmt: skip
    try:
        model_dir = build_model(
            args.shape, args.device, getattr(torch, args.dtype), args.tokenizer, work / "m"
        )
        config = EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype=args.dtype, device=args.device),
            cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gb * GiB)),
            scheduler=SchedulerConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=8192),
        )
        engine = LLMEngine(config)
        report["overlap_steps"] = engine.overlap_steps
        rng = random.Random(0)
        vocab = SHAPES[args.shape]["vocab_size"]
        sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

        def run() -> dict:
            # Fresh random prompts each run: the prefix cache must not spare a run its prefill.
            prompts = [
                [rng.randrange(3, vocab) for _ in range(args.input_len)]
                for _ in range(args.num_requests)
            ]
            steps = engine.stats.num_steps
            start = time.perf_counter()
            engine.generate(prompts, [sampling] * len(prompts))
            if args.device == "cuda":
                torch.cuda.synchronize()
            return {"seconds": time.perf_counter() - start,
                    "steps": engine.stats.num_steps - steps}  # fmt: skip

        report["plain"] = run()  # unprofiled, for the profilers' own overhead
        profile = cProfile.Profile()
        profile.enable()
        report["cprofile_run"] = run()
        profile.disable()
        report["python"] = python_table(profile, args.rows)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            report["torch_profiler_run"] = run()
        report["ops"] = op_table(profiler, args.device, args.rows)
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    for row in report["python"]["by_self"][:15]:
        print(f"{row['self_s']:8.3f} s self  {row['calls']:8d}  {row['function']}")
    for row in report["ops"][:15]:
        print(f"{row['self_cpu_us'] / 1e3:8.1f} ms host {row['count']:8d}  {row['op']}")
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
