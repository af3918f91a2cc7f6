"""`pagedserve bench sharing`: what sharing KV blocks buys, one section of the JSON per kind.

Sections: `prefix_caching` (services/bench/prefix_bench.py: throughput and hit rate with and
without prefix caching on shared-prefix workloads). The memory saving of parallel sampling and
beam search belongs in a `memory_saving` section beside it: add its runner to SECTIONS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.bench.commands import write_json
from services.bench.prefix_bench import add_prefix_args, header, run_prefix_caching
from services.engine.args import add_engine_args

# JSON key -> runner(args, vocab_size) -> that section's results.
SECTIONS: dict[str, Callable[[argparse.Namespace, int], dict]] = {
    "prefix_caching": run_prefix_caching,
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
    sharing.add_argument("--num-requests", type=int, default=200)
    sharing.add_argument("--seed", type=int, default=0)
    sharing.add_argument("--json", default=None, help="write the results here")
    sharing.add_argument("--no-progress", dest="progress", action="store_false")
    add_prefix_args(sharing)


def run_sharing(args: argparse.Namespace) -> int:
    from services.executor.weights import load_hf_config
    from shared.model_source import resolve_model

    vocab_size = load_hf_config(resolve_model(args.model)).vocab_size
    results: dict = {"argv": sys.argv[1:], "num_requests": args.num_requests, "seed": args.seed}
    for key in args.sections or list(SECTIONS):
        if key == "prefix_caching":
            print(header())
        results[key] = SECTIONS[key](args, vocab_size)
    write_json(args.json, results)
    return 0
