"""Start-up time of one replica: `pagedserve serve` by the launcher against `serve --ray-address`.

Each round starts the server, times it from the command to its `pagedserve: ready` line (every
process up, the model loaded, /health "ok") and stops it; the two ways alternate so that load
from other work on the machine falls on both, each after the machine settles from the last.
Without --ray-address a local Ray cluster (a head that runs no rank and one 1-CPU node) is
started first; its own start-up is reported apart.

    .venv/bin/python benchmarks/ray_startup.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as on a 1-CPU Ray node, for both ways


def start_once(model: str, extra: list[str], timeout_s: float) -> tuple[float, dict]:
    """Seconds from the command to the ready line, and that line's JSON; the server is stopped
    before returning."""
    argv = [
        sys.executable, "-m", "services.cli", "serve", "--model", model, "--port", "0", *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("pagedserve: ready"):
                return time.perf_counter() - start, json.loads(line.split(" ", 2)[2])
        raise RuntimeError(f"serve {' '.join(extra)} exited with {proc.wait()} before ready")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def local_cluster():
    from ray.cluster_utils import Cluster

    store = 80 * 1024 * 1024  # nothing but actor handles goes through it
    head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": store}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1, object_store_memory=store)
    cluster.wait_for_nodes()
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="what serve --model gets")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default="launcher,ray", help="which of launcher,ray to time")
    parser.add_argument("--ray-address", default=None, help="an existing cluster (default: local)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a stop may take")
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds idle before each timed start: after a stop Ray starts spare workers, "
        "which would otherwise weigh on the next start",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed starts first (the first converts the model)"
    )
    parser.add_argument("--output", default="benchmarks/results/ray_startup.json")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]  # the machine is shared: how busy it was, for the reader
    cluster, cluster_s = None, None
    address = args.ray_address
    if address is None:
        start = time.perf_counter()
        cluster = local_cluster()
        cluster_s = time.perf_counter() - start
        address = cluster.address
    every_way = {"launcher": [], "ray": ["--ray-address", address]}
    ways = {way: every_way[way] for way in args.ways.split(",")}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    # Of a start on Ray, Ray's own steps (the rest is the same processes as the launcher's).
    ray_steps: dict[str, list[float]] = {"connect": [], "place": []}
    try:
        for _ in range(args.warmup):
            start_once(args.model, [], args.timeout)
        for _ in range(args.rounds):
            for way, extra in ways.items():
                time.sleep(args.settle)
                elapsed, ready = start_once(args.model, extra, args.timeout)
                seconds[way].append(elapsed)
                if "ray_s" in ready:
                    ray_steps["connect"].append(ready["ray_s"]["connect"])
                    ray_steps["place"].append(max(ready["ray_s"]["place"]))
                print(f"{way}: {seconds[way][-1]:.2f} s", flush=True)
    finally:
        if cluster is not None:
            cluster.shutdown()
    result = {
        "model": args.model,
        "rounds": args.rounds,
        "settle_s": args.settle,
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "ray_cluster": "local: head with 0 CPUs + one 1-CPU node" if cluster_s else address,
        "ray_cluster_start_s": cluster_s,
        "startup_s": seconds,
        "median_startup_s": {way: statistics.median(s) for way, s in seconds.items()},
        "ray_steps_s": ray_steps,
        "median_ray_steps_s": {k: statistics.median(v) for k, v in ray_steps.items() if v},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median_startup_s"]))


if __name__ == "__main__":
    main()
