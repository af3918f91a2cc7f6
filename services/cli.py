"""The `pagedserve` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.config_args import add_engine_args, engine_config_from_args
from shared.errors import PagedServeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description="Paged-KV LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)

    from services.engine.offline import add_generate_args, run_generate

    generate = commands.add_parser("generate", help="run a JSONL file of prompts offline")
    add_engine_args(generate)
    add_generate_args(generate)

    from services.gateway.service import add_gateway_args

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API (three processes)")
    add_engine_args(serve)
    add_gateway_args(serve)
    serve.add_argument("--plan-log", default=None, help="scheduler: append one JSON line per step")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names requests may give as `model` (default: the model's own name), each "
        "listed by /v1/models; the first is the one the ready line and /openapi.json report",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="scheduler+executor stacks behind the gateway (requests go to the least loaded)",
    )
    serve.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="HTTP gateway processes sharing the port (SSE streaming is CPU work per token; "
        "one process streams at most ~20,000 tokens/s per core here)",
    )
    from services.restart_budget import add_restart_args

    add_restart_args(serve)
    _add_ray_args(serve)

    from services.bench.commands import add_bench_parser

    add_bench_parser(commands)

    args = parser.parse_args(argv)
    if args.command == "bench":
        from services.bench.commands import run_bench

        return _reporting_errors(run_bench, args)
    if args.command == "serve":
        from services.launcher import serve as run_serve

        return _reporting_errors(run_serve, args)
    try:
        config = engine_config_from_args(args)
        from services.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except (PagedServeError, ValueError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    return run_generate(args, engine)


def _add_ray_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("Ray cluster (pip install 'pagedserve[ray]')")
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="place each replica's executor ranks on this Ray cluster (HOST:PORT of its head, "
        "or auto) as actors, one placement group per replica; schedulers and gateways run "
        "here. A lost rank or node gets its replica re-placed (counted on /metrics)",
    )
    group.add_argument(
        "--ray-placement-strategy",
        default="STRICT_PACK",
        choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
        help="how one replica's ranks are placed: STRICT_PACK keeps them on one node (fast "
        "all-reduces); the others let them span nodes",
    )
    group.add_argument(
        "--ray-cpus-per-rank",
        type=float,
        default=1.0,
        help="CPUs each rank reserves on its node (beside one GPU with --device cuda)",
    )


def _reporting_errors(command: Callable[[argparse.Namespace], int], args) -> int:
    """Run a command; a bad flag or request is one line on stderr and exit code 2."""
    try:
        return command(args)
    except (PagedServeError, ValueError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
