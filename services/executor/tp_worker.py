"""A tensor-parallel rank other than 0: joins rank 0, then runs every plan rank 0 broadcasts.

Started by rank 0 for local ranks, or by hand for ranks on other machines:

    python -m services.executor.tp_worker --rank 1 --tensor-parallel-size 2 \\
        --tp-master-addr HOST0 --tp-master-port 29500 [the same engine flags as rank 0]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from services.config_args import add_config_json_arg, add_engine_args, engine_config_from_args
from services.executor.executor import Executor
from shared.model_source import resolve_model

log = logging.getLogger("pagedserve.tp_worker")


def _exit_with_parent(parent_pid: int) -> None:
    # A rank blocked in a collective cannot notice that rank 0's process is gone; this can.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    log.warning("rank 0 is gone; exiting")
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.executor.tp_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this one exits")
    add_engine_args(parser)
    add_config_json_arg(parser)  # local ranks get rank 0's config
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = engine_config_from_args(args)
    if args.parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    size = config.parallel.tensor_parallel_size
    if not 0 < args.rank < size:
        print(f"tp_worker: rank must be in [1, {size})", file=sys.stderr)
        return 2
    model_dir = resolve_model(config.model.model, config.model.download_dir)
    executor = Executor(config, model_dir, rank=args.rank)
    try:
        executor.follow()
    except Exception as exc:  # noqa: BLE001 - a failed step, or rank 0 gone mid-collective
        log.error("rank %d stops: %s", args.rank, (str(exc).splitlines() or [repr(exc)])[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
