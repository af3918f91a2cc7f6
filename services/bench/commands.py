"""`pagedserve bench`: its subcommands' arguments and the dispatch to each."""

from __future__ import annotations

import argparse
import math

from services.config_args import add_engine_args
from services.scheduler.kv_policy import KV_POLICIES


def add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="reproduce the paper's memory, latency and sharing figures"
    )
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

    from services.bench.sharing_command import add_sharing_parser

    add_sharing_parser(sub)


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
    if args.bench_command == "sharing":
        from services.bench.sharing_command import run_sharing

        return run_sharing(args)
    args.kv_policies = args.kv_policies or list(KV_POLICIES)
    args.kv_policy = "paged"  # engine_config_from_args needs one; each run replaces it
    if args.bench_command == "memory":
        from services.bench.memory_command import run_memory

        return run_memory(args)
    from services.bench.serve_command import run_serve

    return run_serve(args)
