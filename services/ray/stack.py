"""The launcher's Stack with each replica's executor ranks placed on a Ray cluster: schedulers and
gateways stay on this machine (Ray's driver), listening on tcp:// so that ranks on any node reach
them; a lost replica is re-placed by its RayReplica and counted for /metrics."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import ray

from services.launcher import Stack
from services.ray.replica import RankResources, RayReplica
from services.ray.spread import ReplicaSpread
from services.restart_budget import RestartBudget
from shared.config import EngineConfig
from shared.ipc import Addresses

# Passed on to every rank's process: the launcher's settings that are not engine flags.
_FORWARDED_ENV = ("OMP_NUM_THREADS", "TRITON_INTERPRET", "HF_HOME", "HF_HUB_OFFLINE")


class RayStack(Stack):
    def __init__(self, args) -> None:
        # "auto": the cluster this machine is a node of. The ranks' output stays in Ray's worker
        # logs on their nodes rather than crowding this process's.
        if args.ray_address != "auto":
            _check_reachable(args.ray_address)  # ray.init would retry a wrong one for minutes
        started = time.perf_counter()
        try:
            ray.init(address=args.ray_address, log_to_driver=False)
        except ConnectionError as exc:
            raise ValueError(f"no Ray cluster at {args.ray_address}: {exc}") from exc
        self.connect_s = time.perf_counter() - started
        super().__init__(args)
        self.replicas: list[RayReplica] = []
        self.spread = ReplicaSpread()
        self._lock = threading.Lock()  # the placement file is written from watcher threads
        # The address ranks on other nodes reach this machine at (its Ray node's).
        self.host_ip = ray.util.get_node_ip_address()

    def _replica_addresses(self, index: int) -> Addresses:
        ports = [_free_port(self.host_ip) for _ in range(3)]
        return Addresses(*(f"tcp://{self.host_ip}:{port}" for port in ports))

    def _start_executor(
        self,
        index: int,
        name: str,
        engine: EngineConfig,
        wires: list[str],
        env: dict[str, str] | None,
    ) -> None:
        # Ray reserves each rank's device and sets CUDA_VISIBLE_DEVICES in its actor: the local
        # launcher's device split does not apply. The rank's actor gives its own --parent-pid.
        at = wires.index("--parent-pid")
        wires = wires[:at] + wires[at + 2 :]
        args = self.args
        gpus = 1.0 if engine.model.device == "cuda" else 0.0
        replica = RayReplica(
            index,
            engine,
            wires,
            {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ},
            RankResources(cpus=args.ray_cpus_per_rank, gpus=gpus),
            args.ray_placement_strategy,
            self.spread,
            RestartBudget(args.max_restarts, args.restart_window),
            self._on_replica_event,
        )
        self.replicas.append(replica)
        self._write_placement()
        replica.start()

    def _gateway_extra_argv(self) -> list[str]:
        return ["--placement-file", self._placement_file()]

    def _placement_file(self) -> str:
        return os.path.join(self.ipc_dir, "placement.json")

    def _on_replica_event(self, event: str, replica: RayReplica) -> None:
        if not os.path.isdir(self.ipc_dir):
            return  # stopped: nobody reads it any more
        self._write_placement()
        if event == "placed" and replica.replacements:
            print(
                f"pagedserve: replica {replica.index} re-placed "
                f"{json.dumps({'nodes': replica.nodes, 'replacements': replica.replacements})}",
                flush=True,
            )
        elif event == "lost":
            print(f"pagedserve: replica {replica.index} lost its ranks", flush=True)
        elif event == "given up":
            print(
                f"pagedserve: replica {replica.index} lost with its restart budget "
                f"({replica.budget.describe()}) spent; it stays down",
                file=sys.stderr,
                flush=True,
            )

    def _write_placement(self) -> None:
        """What the gateway's /metrics reads: re-placements and nodes per replica."""
        with self._lock:
            body = {
                str(r.index): {"replacements": r.replacements, "nodes": r.nodes}
                for r in self.replicas
            }
            path = self._placement_file()
            with open(f"{path}.tmp", "w") as f:
                json.dump(body, f)
            os.replace(f"{path}.tmp", path)  # a scrape never reads half a file

    def ready_info(self) -> dict:
        """Where each replica's ranks run, and the seconds Ray's own steps took: connecting
        this driver, and per replica reserving its group and starting its ranks' actors."""
        return {
            "placement": {str(r.index): r.nodes for r in self.replicas},
            "ray_s": {"connect": self.connect_s, "place": [r.place_s for r in self.replicas]},
        }

    def restart(self, name: str) -> bool:
        """A dead scheduler is restarted here; its replica's ranks are replaced by Ray."""
        if not self.budgets[name].allow():
            return False
        self._spawn(name, self.argv[name])
        if name.startswith("scheduler"):
            index = int(name.split("-")[1]) if "-" in name else 0
            self.replicas[index].recycle()
        return True

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop_watching()
        super().stop()  # the gateways, then the schedulers (which tell each executor to stop)
        for replica in self.replicas:
            replica.stop()
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout_s).close()
    except (OSError, ValueError) as exc:
        raise ValueError(f"no Ray cluster answers at {address} (HOST:PORT): {exc}") from exc


def _free_port(host: str) -> int:
    # The scheduler binds it a moment later; on the head node nothing else races for it.
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
