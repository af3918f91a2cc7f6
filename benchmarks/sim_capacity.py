"""Why paged's sustainable rate is ~1.7x orca-oracle's in the simulator, not more: capacity under
overload, per policy and per assumed step overhead.

Each policy replays the ShareGPT-like trace (OPT-13B on one A100-40GB, the simulated executor)
at a rate above every policy's capacity, so throughput is the policy's ceiling; the script
reports output tokens per second, sequences running (time-averaged), mean step time,
preemptions and the share of computed tokens that were recomputation, and the ratios to
orca-oracle. The virtual clock makes it deterministic.

    .venv/bin/python benchmarks/sim_capacity.py --json benchmarks/results/sim_capacity_sharegpt.json
"""

from __future__ import annotations

import argparse
import json
import sys

from services.bench.replay import replay
from services.bench.traces import synthetic_trace
from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig, SchedulerConfig, SimConfig


def capacity(policy: str, overhead_s: float, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        executor="sim",
        sim=SimConfig(gpu=args.gpu, model=args.model, step_overhead_s=overhead_s),
        # No prefix caching: the paper's system had none (and this trace shares no prefixes).
        scheduler=SchedulerConfig(kv_policy=policy, enable_prefix_caching=False),
    )
    engine = LLMEngine(config)
    trace = synthetic_trace(
        args.trace, args.num_requests, args.rate, args.seed, engine.scheduler.vocab_size
    )
    result = replay(engine, trace)
    # Without preemption a request computes its prompt and every output token but the last.
    useful = sum(r.prompt_len + r.output_len - 1 for r in result.records)
    output = sum(r.output_len for r in result.records)
    return {
        "output_tokens_per_s": output / result.duration_s,
        "mean_running_seqs": result.mean_running,
        "max_running_seqs": result.max_running,
        "mean_step_ms": 1e3 * result.duration_s / result.num_steps,
        "num_steps": result.num_steps,
        "num_preemptions": result.num_preemptions,
        "recomputed_share": 1 - useful / result.num_computed_tokens,
        "token_states_while_binding": result.memory_saturated.get("token_states", 0.0),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", default="a100-40gb")
    parser.add_argument("--model", default="opt-13b")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=8.0, help="req/s, above every capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overheads-ms", default="0,5,20")
    parser.add_argument("--policies", default="paged,orca-oracle,orca-pow2,orca-max")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict = {"setup": vars(args), "by_overhead_ms": {}}
    for ms in (float(x) for x in args.overheads_ms.split(",")):
        rows = {p: capacity(p, ms / 1e3, args) for p in args.policies.split(",")}
        base = rows.get("orca-oracle")
        for policy, row in rows.items():
            if base:
                row["throughput_over_oracle"] = (
                    row["output_tokens_per_s"] / base["output_tokens_per_s"]
                )
                row["running_over_oracle"] = row["mean_running_seqs"] / base["mean_running_seqs"]
                row["step_time_over_oracle"] = row["mean_step_ms"] / base["mean_step_ms"]
            print(
                f"overhead {ms:4.0f} ms  {policy:12s} {row['output_tokens_per_s']:7.1f} tok/s  "
                f"running {row['mean_running_seqs']:5.1f} (max {row['max_running_seqs']:3d})  "
                f"step {row['mean_step_ms']:5.1f} ms  preemptions {row['num_preemptions']:4d}  "
                f"recomputed {100 * row['recomputed_share']:4.1f}%"
                + (
                    f"  vs oracle: tok/s x{row['throughput_over_oracle']:.2f}, running "
                    f"x{row['running_over_oracle']:.2f}, step x{row['step_time_over_oracle']:.2f}"
                    if base
                    else ""
                ),
                flush=True,
            )
        report["by_overhead_ms"][f"{ms:g}"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
