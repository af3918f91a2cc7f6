"""`pagedserve bench serve`: normalized latency against request rate per policy (Figure 12)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from services.bench.latency import max_sustainable_rate, summarize
from services.bench.policy_runs import (
    PAPER_RATE_RATIOS,
    engine_for,
    make_trace,
    run_setup,
    write_json,
)
from services.bench.traces import trace_stats


def _row(label: str, summary: dict) -> str:
    def get(key: str) -> float:
        return summary.get(key, math.nan)

    return (
        f"{label:12s} rate {summary['rate']:7.3f} req/s"
        f"  normalized {get('normalized_latency_s'):7.3f} s/tok"
        f"  ttft {get('mean_ttft_s'):7.2f} s  tpot {get('mean_tpot_s'):6.3f} s"
        f"  {summary.get('output_throughput', 0.0):8.1f} tok/s"
    )


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
                    trace = make_trace(args, rate, args.vocab_size)
                    records, duration = asyncio.run(
                        run_load(url, trace, args.api_key, args.progress)
                    )
                    setup = setup or {"argv": sys.argv[1:], "mode": "http"}
                else:
                    from services.bench.replay import replay

                    engine = engine_for(args, label)
                    trace = make_trace(args, rate, engine.scheduler.vocab_size)
                    setup = setup or {**run_setup(args, engine), "mode": "in-process replay"}
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
    write_json(
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
