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

import numpy as np
import torch

from services.bench.cpu_rates import copy_bandwidth, matmul_gflops
from services.bench.traces import scale_trace, synthetic_trace
from services.engine.llm_engine import LLMEngine
from services.executor.cost_model import MODELS, GpuSpec, step_cost
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams


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


def _features(plans, model) -> np.ndarray:
    """[steps, 2]: FLOPs and 1. The bytes a step moves barely vary here (the weights dominate
    them), so they are not separable from the constant; the constant absorbs them."""
    unit = GpuSpec("unit", 0, 1.0, 1.0, 1.0, 0.0)
    return np.array([[step_cost(p, unit, model, 16, 0.0).flops, 1.0] for p in plans])


def _fit_effective(plans, model, measured: np.ndarray) -> dict[str, float]:
    """measured = flops / F + c by least squares: the GEMM rate steps really reach, and a fixed
    cost per step that includes streaming the weights."""
    (per_flop, constant), *_ = np.linalg.lstsq(_features(plans, model), measured, rcond=None)
    if per_flop <= 0:
        raise RuntimeError(f"effective-rate fit is not physical: {per_flop} s per FLOP")
    return {"flops": float(1 / per_flop), "constant_s": float(constant)}


def _effective_seconds(plans, model, fit: dict[str, float]) -> np.ndarray:
    return _features(plans, model) @ np.array([1 / fit["flops"], fit["constant_s"]])


def _errors(modeled: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    rel = np.abs(modeled - measured) / measured
    return {
        "total_error": float(modeled.sum() / measured.sum() - 1),
        "step_mean_abs_error": float(rel.mean()),
        "step_p90_abs_error": float(np.percentile(rel, 90)),
    }


# (name, seed, requests, length scale): the fit run and the held-out check run.
RUNS = (("fit", 0, 12, 0.1), ("check", 1, 16, 0.08))
# Small, but with prompts long enough that a prefill step clearly costs more than a decode step
# (the fit needs that slope).
SMOKE_RUNS = (("fit", 0, 3, 0.05), ("check", 1, 2, 0.03))


def calibrate(engine: LLMEngine, gpu: GpuSpec, model, runs_spec=RUNS) -> dict:
    """One fit run, one held-out check run; each calibration's errors on both."""
    runs = {}
    for name, seed, num_requests, scale in runs_spec:
        plans, measured = measured_run(engine, seed, num_requests, scale)
        roofline = np.array([step_cost(p, gpu, model, 16, 0.0).seconds for p in plans])
        runs[name] = (plans, measured, roofline)
    plans, measured, roofline = runs["fit"]
    # The calibration: vendor-style peaks (here the microbenchmarks) plus one fitted
    # per-step overhead, the mean of measured minus modeled time.
    overhead = float(np.mean(measured - roofline))
    effective = _fit_effective(plans, model, measured)
    report = {"fitted_step_overhead_s": overhead, "effective_rate_fit": effective, "runs": {}}
    for name, (plans, measured, roofline) in runs.items():
        report["runs"][name] = {
            "num_steps": len(plans),
            "mean_tokens_per_step": float(np.mean([p.num_tokens for p in plans])),
            "measured_total_s": float(measured.sum()),
            "roofline_share_of_measured": float(roofline.sum() / measured.sum()),
            "peak_plus_overhead": _errors(roofline + overhead, measured),
            "effective_rates": _errors(_effective_seconds(plans, model, effective), measured),
        }
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="fit/check pairs, for the spread")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny runs and short probes: checks it runs, no figure"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    probe_s = 0.05 if args.smoke else 1.0
    flops = matmul_gflops(64, 576, 1536, probe_s) * 1e9
    bandwidth = copy_bandwidth(seconds=probe_s)
    print(f"this CPU now: fp32 GEMM {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.2f} GB/s")
    gpu = GpuSpec("cpu-measured", 0, bandwidth, flops, bandwidth, 0.0)
    model = MODELS["smollm2-135m"]
    config = EngineConfig(
        # fp32 weights: the cost model counts 4-byte parameters and the probe is an fp32 GEMM.
        model=ModelConfig(num_threads=args.threads, device="cpu", quantization="none"),
        cache=CacheConfig(num_device_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    engine = LLMEngine(config)
    repeats = []
    for index in range(args.repeats):
        report = calibrate(engine, gpu, model, SMOKE_RUNS if args.smoke else RUNS)
        repeats.append(report)
        eff = report["effective_rate_fit"]
        print(
            f"repeat {index}: overhead {1e3 * report['fitted_step_overhead_s']:.1f} ms; "
            f"effective {eff['flops'] / 1e9:.1f} GFLOP/s + {1e3 * eff['constant_s']:.1f} ms"
        )
        for name, entry in report["runs"].items():
            peak, effective = entry["peak_plus_overhead"], entry["effective_rates"]
            print(
                f"  {name:6s} {entry['num_steps']:3d} steps, measured "
                f"{entry['measured_total_s']:6.2f} s; peak+overhead total "
                f"{100 * peak['total_error']:+.1f}%"
                f" (step |err| {100 * peak['step_mean_abs_error']:.0f}%)"
                f"; effective total {100 * effective['total_error']:+.1f}%"
                f" (step |err| {100 * effective['step_mean_abs_error']:.0f}%)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cpu_gemm_flops": flops,
                    "cpu_copy_bytes_per_s": bandwidth,
                    "repeats": repeats,
                    "config": dataclasses.asdict(config),
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
