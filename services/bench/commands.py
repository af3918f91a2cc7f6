"""`pagedserve bench`: its arguments and the helpers its memory and serve commands share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from services.bench.traces import (
    load_sharegpt,
    scale_trace,
    shared_prefix_trace,
    synthetic_trace,
)
from services.engine.args import add_engine_args, engine_config_from_args
from services.scheduler.kv_policy import KV_POLICIES

# The paper's Figure 2 (OPT-13B, A100-40GB, ShareGPT): share of KV memory holding token states.
PAPER_TOKEN_STATES = {"paged": 0.963, "orca-max": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382}
# Section 6.2: vLLM sustains 1.7-2.7x the rate of Orca (Oracle) and 2.7-8x that of Orca (Max).
PAPER_RATE_RATIOS = {"orca-oracle": [1.7, 2.7], "orca-max": [2.7, 8.0]}


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


# ---- shared helpers ---------------------------------------------------------------------------


def engine_for(args: argparse.Namespace, policy: str):
    from services.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, kv_policy=policy)
    )
    return LLMEngine(config)


def make_trace(args: argparse.Namespace, rate: float, vocab_size: int, tokenizer=None):
    if args.sharegpt_json:
        trace = load_sharegpt(args.sharegpt_json, tokenizer, args.num_requests, rate, args.seed)
    elif args.trace.startswith("shared-prefix"):
        shots = int(args.trace.rsplit("-", 1)[1])
        trace = shared_prefix_trace(shots, args.num_requests, rate, args.seed, vocab_size)
    else:
        trace = synthetic_trace(args.trace, args.num_requests, rate, args.seed, vocab_size)
    return scale_trace(trace, args.length_scale)


def run_setup(args: argparse.Namespace, engine) -> dict:
    scheduler = engine.scheduler
    return {
        "argv": sys.argv[1:],
        "executor": engine.config.executor,
        "sim": dataclasses.asdict(engine.config.sim) if engine.config.executor == "sim" else None,
        "num_device_blocks": scheduler.block_manager.device.num_blocks,
        "block_size": scheduler.block_size,
        "max_seq_len": scheduler.max_seq_len,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_prefill_tokens_per_request": scheduler.prefill_cap,
        "preemption_mode": engine.config.scheduler.preemption_mode,
    }


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")
