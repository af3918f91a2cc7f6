"""`pagedserve bench sharing`: what sharing KV blocks buys, one section of the JSON per kind.

Sections: `prefix_caching` (services/bench/prefix_bench.py: throughput and hit rate with and
without prefix caching on shared-prefix workloads) and `memory_saving`
(services/bench/memory_saving.py: KV memory saved by parallel samples and beams, the paper's
section 6.3, prefix caching off). A new section is a runner in SECTIONS and its flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.bench.memory_saving import (
    add_memory_saving_args,
    run_memory_saving,
    without_prefix_caching,
)
from services.bench.policy_runs import write_json
from services.bench.prefix_bench import add_prefix_args, header, run_prefix_caching
from services.config_args import add_engine_args, engine_config_from_args


def _memory_saving(args: argparse.Namespace, vocab_size: int) -> dict:
    from services.engine.llm_engine import LLMEngine

    config = without_prefix_caching(engine_config_from_args(args))
    return run_memory_saving(args, lambda: LLMEngine(config))


def _prefix_caching(args: argparse.Namespace, vocab_size: int) -> dict:
    print(header())
    return run_prefix_caching(args, vocab_size)


# JSON key -> runner(args, vocab_size) -> that section's results.
SECTIONS: dict[str, Callable[[argparse.Namespace, int], dict]] = {
    "prefix_caching": _prefix_caching,
    "memory_saving": _memory_saving,
}


def add_sharing_parser(sub) -> None:
    sharing = sub.add_parser(
        "sharing", help="prefix caching (and block sharing) gains", conflict_handler="resolve"
    )
    add_engine_args(sharing)
    sharing.add_argument(
        "--section",
        dest="sections",
        action="append",
        choices=list(SECTIONS),
        help="part to run (repeat it); default: all",
    )
    sharing.add_argument(
        "--num-requests", type=int, default=200, help="requests per prefix-caching workload"
    )
    sharing.add_argument("--seed", type=int, default=0)
    sharing.add_argument("--json", default=None, help="write the results here")
    sharing.add_argument("--no-progress", dest="progress", action="store_false")
    add_prefix_args(sharing)
    add_memory_saving_args(sharing)


def run_sharing(args: argparse.Namespace) -> int:
    from services.executor.weights import load_hf_config
    from shared.model_source import resolve_model

    vocab_size = load_hf_config(resolve_model(args.model)).vocab_size
    results: dict = {"argv": sys.argv[1:], "num_requests": args.num_requests, "seed": args.seed}
    for key in args.sections or list(SECTIONS):
        results[key] = SECTIONS[key](args, vocab_size)
    write_json(args.json, results)
    return 0
