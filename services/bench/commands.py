"""`pagedserve bench memory|serve`: the paper's Figure 2 (KV memory by kind, per allocation
policy) and Figure 12 (normalized latency against request rate, per policy)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys

from services.bench.latency import max_sustainable_rate, summarize
from services.bench.traces import (
    load_sharegpt,
    scale_trace,
    shared_prefix_trace,
    synthetic_trace,
    trace_stats,
)
from services.engine.args import add_engine_args, engine_config_from_args
from services.scheduler.kv_accounting import KINDS
from services.scheduler.kv_policy import KV_POLICIES

# The paper's Figure 2 (OPT-13B, A100-40GB, ShareGPT): share of KV memory holding token states.
PAPER_TOKEN_STATES = {"paged": 0.963, "orca-max": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382}
# Section 6.2: vLLM sustains 1.7-2.7x the rate of Orca (Oracle) and 2.7-8x that of Orca (Max).
PAPER_RATE_RATIOS = {"orca-oracle": [1.7, 2.7], "orca-max": [2.7, 8.0]}


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="reproduce the paper's memory and latency figures")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    memory = sub.add_parser(
        "memory", help="KV memory breakdown per allocation policy", conflict_handler="resolve"
    )
    serve = sub.add_parser(
        "serve", help="normalized latency against request rate", conflict_handler="resolve"
    )
    for parser in (memory, serve):
        add_engine_args(parser)
        _add_workload_args(parser)
    memory.add_argument(
        "--rate", type=float, default=math.inf, help="requests/s (default: all at once)"
    )
    memory.add_argument("--plot", default=None, help="PNG of the breakdown")
    serve.add_argument("--rates", required=True, help="comma-separated request rates (req/s)")
    serve.add_argument(
        "--latency-bound",
        default="0.1",
        help="normalized latency (s/token) a sustainable rate stays under; a comma-separated "
        "list reports each, the first is the headline",
    )
    serve.add_argument("--plot", default=None, help="PNG of latency against rate")
    serve.add_argument(
        "--url", default=None, help="load a running gateway over HTTP/SSE (one curve)"
    )
    serve.add_argument(
        "--launch",
        action="store_true",
        help="start `pagedserve serve` per policy (engine flags apply) and load it over HTTP",
    )
    serve.add_argument("--port", type=int, default=8123, help="port for --launch")
    serve.add_argument("--api-key", default=None)
    serve.add_argument(
        "--vocab-size", type=int, default=32000, help="prompt token ids below this (HTTP modes)"
    )
    serve.add_argument(
        "--stop-factor",
        type=float,
        default=5.0,
        help="skip a policy's higher rates once its latency exceeds this times the bound",
    )


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--kv-policy",
        dest="kv_policies",
        action="append",
        choices=KV_POLICIES,
        help="allocation policy to compare (repeat it); default: all four",
    )
    group.add_argument(
        "--trace",
        default="sharegpt",
        choices=["sharegpt", "alpaca", "shared-prefix-1", "shared-prefix-5"],
    )
    group.add_argument("--sharegpt-json", default=None, help="sample a ShareGPT JSON file instead")
    group.add_argument("--num-requests", type=int, default=1000)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply every length (CPU-sized runs)"
    )
    group.add_argument("--json", default=None, help="write the results here")
    group.add_argument("--no-progress", dest="progress", action="store_false")


def run_bench(args: argparse.Namespace) -> int:
    args.kv_policies = args.kv_policies or list(KV_POLICIES)
    args.kv_policy = "paged"  # engine_config_from_args needs one; each run replaces it
    if args.bench_command == "memory":
        return run_memory(args)
    return run_serve(args)


# ---- shared helpers ---------------------------------------------------------------------------


def _engine(args: argparse.Namespace, policy: str):
    from services.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, kv_policy=policy)
    )
    return LLMEngine(config)


def _trace(args: argparse.Namespace, rate: float, vocab_size: int, tokenizer=None):
    if args.sharegpt_json:
        trace = load_sharegpt(args.sharegpt_json, tokenizer, args.num_requests, rate, args.seed)
    elif args.trace.startswith("shared-prefix"):
        shots = int(args.trace.rsplit("-", 1)[1])
        trace = shared_prefix_trace(shots, args.num_requests, rate, args.seed, vocab_size)
    else:
        trace = synthetic_trace(args.trace, args.num_requests, rate, args.seed, vocab_size)
    return scale_trace(trace, args.length_scale)


def _setup(args: argparse.Namespace, engine) -> dict:
    scheduler = engine.scheduler
    return {
        "argv": sys.argv[1:],
        "executor": engine.config.executor,
        "sim": dataclasses.asdict(engine.config.sim) if engine.config.executor == "sim" else None,
        "num_device_blocks": scheduler.block_manager.device.num_blocks,
        "block_size": scheduler.block_size,
        "max_seq_len": scheduler.max_seq_len,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "preemption_mode": engine.config.scheduler.preemption_mode,
    }


def _write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")


def _row(label: str, summary: dict) -> str:
    def get(key: str) -> float:
        return summary.get(key, math.nan)

    return (
        f"{label:12s} rate {summary['rate']:7.3f} req/s"
        f"  normalized {get('normalized_latency_s'):7.3f} s/tok"
        f"  ttft {get('mean_ttft_s'):7.2f} s  tpot {get('mean_tpot_s'):6.3f} s"
        f"  {summary.get('output_throughput', 0.0):8.1f} tok/s"
    )


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


# ---- bench memory -----------------------------------------------------------------------------


def run_memory(args: argparse.Namespace) -> int:
    from services.bench.replay import replay

    policies, whole, runs = {}, {}, {}
    setup = trace_info = None
    for policy in args.kv_policies:
        engine = _engine(args, policy)
        tokenizer = engine.tokenizer if args.sharegpt_json else None
        trace = _trace(args, args.rate, engine.scheduler.vocab_size, tokenizer)
        trace_info = trace_info or trace_stats(trace)
        setup = setup or _setup(args, engine)
        result = replay(engine, trace, progress=args.progress)
        # The breakdown while memory binds (some request waits for admission); a run that never
        # waited falls back to its whole-run average.
        saturated = result.saturated_s > 0
        policies[policy] = result.memory_saturated if saturated else result.memory
        whole[policy] = result.memory
        runs[policy] = {
            "saturated_s": result.saturated_s,
            "duration_s": result.duration_s,
            "num_steps": result.num_steps,
            "num_preemptions": result.num_preemptions,
            "max_running_seqs": result.max_running,
            "latency": summarize(result.records, result.duration_s),
        }
        del engine
    print(f"{'policy':12s} " + " ".join(f"{k[:12]:>12s}" for k in KINDS) + "  paper tokens")
    for policy, fractions in policies.items():
        cells = " ".join(f"{_pct(fractions[k]):>12s}" for k in KINDS)
        print(f"{policy:12s} {cells}  {_pct(PAPER_TOKEN_STATES[policy]):>12s}")
    _write_json(
        args.json,
        {
            "setup": setup,
            "trace": trace_info,
            "rate": None if math.isinf(args.rate) else args.rate,
            "window": "steps after which a request waited for admission (memory binds)",
            "policies": policies,
            "whole_run": whole,
            "runs": runs,
            "paper_token_states": PAPER_TOKEN_STATES,
        },
    )
    if args.plot:
        from services.bench.plots import plot_memory

        plot_memory(policies, args.plot, f"KV cache usage ({args.trace}, {setup['executor']})")
        print(f"wrote {args.plot}")
    return 0


# ---- bench serve ------------------------------------------------------------------------------


def _sustainable(curves: dict[str, list[dict]], bound: float) -> tuple[dict, dict]:
    """Max sustainable rate per curve at `bound`, and paged's rate over each other policy's."""
    sustainable = {
        label: max_sustainable_rate(
            [p["rate"] for p in points],
            [p.get("normalized_latency_s", math.nan) for p in points],
            bound,
        )
        for label, points in curves.items()
    }
    ratios = {}
    if "paged" in sustainable:
        for label, rate in sustainable.items():
            if label != "paged":
                ratios[label] = sustainable["paged"] / rate if rate > 0 else math.inf
    return sustainable, ratios


def run_serve(args: argparse.Namespace) -> int:
    rates = sorted(float(r) for r in args.rates.split(","))
    labels = ["server"] if args.url else args.kv_policies
    curves: dict[str, list[dict]] = {label: [] for label in labels}
    headline_bound = float(args.latency_bound.split(",")[0])
    setup = trace_info = None
    servers = {}
    try:
        if args.launch:
            from services.bench.server import Server

            # All servers up at once (idle ones cost only heartbeats), so that each rate runs
            # every policy back to back: drift in a shared machine's load hits them alike.
            for index, label in enumerate(labels):
                servers[label] = Server(args, label, args.port + index)
            for server in servers.values():
                server.wait_ready()
        for rate in rates:
            for label in labels:
                points = curves[label]
                last = points[-1].get("normalized_latency_s", math.inf) if points else 0.0
                if last > args.stop_factor * headline_bound:
                    continue  # far past the knee: higher rates only take longer
                if args.url or args.launch:
                    from services.bench.http_load import run_load

                    url = args.url or servers[label].url
                    trace = _trace(args, rate, args.vocab_size)
                    records, duration = asyncio.run(
                        run_load(url, trace, args.api_key, args.progress)
                    )
                    setup = setup or {"argv": sys.argv[1:], "mode": "http"}
                else:
                    from services.bench.replay import replay

                    engine = _engine(args, label)
                    trace = _trace(args, rate, engine.scheduler.vocab_size)
                    setup = setup or {**_setup(args, engine), "mode": "in-process replay"}
                    result = replay(engine, trace, progress=args.progress)
                    records, duration = result.records, result.duration_s
                trace_info = trace_info or trace_stats(trace)
                summary = summarize(records, duration)
                summary["rate"] = rate
                summary["num_errors"] = sum(
                    1 for r in records if r.finish_reason not in ("length", "stop")
                )
                points.append(summary)
                print(_row(label, summary), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    bounds = [float(b) for b in args.latency_bound.split(",")]
    bound = bounds[0]
    sustainable_by_bound, ratios_by_bound = {}, {}
    for b in bounds:
        sustainable_by_bound[b], ratios_by_bound[b] = _sustainable(curves, b)
    for b in bounds:
        print(f"max sustainable rate (normalized latency <= {b:g} s/token):")
        sustainable, ratios = sustainable_by_bound[b], ratios_by_bound[b]
        for label, rate in sustainable.items():
            extra = f"  paged / this = {ratios[label]:.2f}x" if label in ratios else ""
            paper = PAPER_RATE_RATIOS.get(label)
            extra += f"  (paper {paper[0]}-{paper[1]}x)" if paper and extra else ""
            print(f"  {label:12s} {rate:8.3f} req/s{extra}")
    sustainable, ratios = sustainable_by_bound[bound], ratios_by_bound[bound]
    _write_json(
        args.json,
        {
            "setup": setup,
            "trace": trace_info,
            "latency_bound_s_per_token": bound,
            "curves": curves,
            "max_sustainable_rate": sustainable,
            "paged_over_policy": ratios,
            "paper_paged_over_policy": PAPER_RATE_RATIOS,
            "by_bound": {
                str(b): {
                    "max_sustainable_rate": sustainable_by_bound[b],
                    "paged_over_policy": ratios_by_bound[b],
                }
                for b in bounds
            },
        },
    )
    if args.plot:
        from services.bench.plots import plot_latency

        plot_latency(
            {
                label: [
                    (p["rate"], p["normalized_latency_s"]) for p in points if p.get("num_finished")
                ]
                for label, points in curves.items()
            },
            args.plot,
            f"Normalized latency ({args.trace})",
            bound,
        )
        print(f"wrote {args.plot}")
    return 0
