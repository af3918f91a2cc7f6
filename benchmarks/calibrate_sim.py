"""Calibrate the simulated executor's per-step overhead against a measured run on this CPU.

Runs the embedded SmolLM2-135M through the real engine on a small ShareGPT-shaped trace, times
every step, and models the same plans with the cost model of this machine (its fp32 GEMM rate and
copy bandwidth measured here, now). The overhead is the mean of measured minus modeled time on a
first run; a second, different run checks how close the calibrated model lands.

    .venv/bin/python benchmarks/calibrate_sim.py --json benchmarks/results/calibrate_sim_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline_throughput import matmul_gflops  # noqa: E402  (this script's own folder)

from services.bench.traces import scale_trace, synthetic_trace  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.executor.cost_model import MODELS, GpuSpec, step_cost  # noqa: E402
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def copy_bandwidth(num_bytes: int = 256 << 20, seconds: float = 1.0) -> float:
    src = torch.empty(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dst.copy_(src)
        count += 1
    return 2 * num_bytes * count / (time.perf_counter() - start)  # read + write


def measured_run(engine: LLMEngine, seed: int, num_requests: int, scale: float):
    """(plans, seconds per engine step) for a trace of requests that all arrive at once."""
    trace = scale_trace(synthetic_trace("sharegpt", num_requests, float("inf"), seed, 49152), scale)
    for r in trace:
        sampling = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(list(r.prompt_token_ids), sampling)
    plans, seconds = [], []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - t0)
    engine.scheduler.schedule = schedule
    return plans, np.array(seconds)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flops, bandwidth = matmul_gflops(64, 576, 1536) * 1e9, copy_bandwidth()
    print(f"this CPU now: fp32 GEMM {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.2f} GB/s")
    gpu = GpuSpec("cpu-measured", 0, bandwidth, flops, bandwidth, 0.0)
    model = MODELS["smollm2-135m"]
    config = EngineConfig(
        model=ModelConfig(num_threads=args.threads, device="cpu"),
        cache=CacheConfig(num_device_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    engine = LLMEngine(config)
    runs = {}
    for name, seed, num_requests, scale in (("fit", 0, 12, 0.1), ("check", 1, 16, 0.08)):
        plans, measured = measured_run(engine, seed, num_requests, scale)
        roofline = np.array([step_cost(p, gpu, model, 16, 0.0).seconds for p in plans])
        runs[name] = (plans, measured, roofline)
        print(f"{name}: {len(plans)} steps, measured {measured.sum():.2f} s")
    _, measured, roofline = runs["fit"]
    overhead = float(np.mean(measured - roofline))
    # Diagnostic only: also fit a scale on the roofline (measured = a * roofline + b), which
    # absorbs a machine slower or faster than its microbenchmarks say.
    scale, offset = (float(x) for x in np.polyfit(roofline, measured, 1))
    report = {
        "cpu_gemm_flops": flops,
        "cpu_copy_bytes_per_s": bandwidth,
        "fitted_step_overhead_s": overhead,
        "two_parameter_fit": {"roofline_scale": scale, "overhead_s": offset},
        "runs": {},
    }
    for name, (plans, measured, roofline) in runs.items():
        two = scale * roofline + offset
        modeled = roofline + overhead
        rel = np.abs(modeled - measured) / measured
        entry = {
            "num_steps": len(plans),
            "mean_tokens_per_step": float(np.mean([p.num_tokens for p in plans])),
            "measured_total_s": float(measured.sum()),
            "modeled_total_s": float(modeled.sum()),
            "total_error": float(modeled.sum() / measured.sum() - 1),
            "step_mean_abs_error": float(rel.mean()),
            "step_p90_abs_error": float(np.percentile(rel, 90)),
            "roofline_share_of_measured": float(roofline.sum() / measured.sum()),
            "two_parameter_total_error": float(two.sum() / measured.sum() - 1),
            "two_parameter_step_mean_abs_error": float(np.mean(np.abs(two - measured) / measured)),
        }
        report["runs"][name] = entry
        print(
            f"{name:6s} measured {entry['measured_total_s']:7.2f} s  modeled "
            f"{entry['modeled_total_s']:7.2f} s  ({100 * entry['total_error']:+.1f}%)  "
            f"per step |err| mean {100 * entry['step_mean_abs_error']:.1f}%"
            f" p90 {100 * entry['step_p90_abs_error']:.1f}%"
        )
    print(f"fitted per-step overhead: {1e3 * overhead:.1f} ms")
    print(f"two-parameter diagnostic: {scale:.2f} x roofline + {1e3 * offset:.1f} ms")
    if args.json:
        report["config"] = dataclasses.asdict(config)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
