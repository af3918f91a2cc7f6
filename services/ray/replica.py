"""One replica's executor ranks on a Ray cluster: a placement group reserves a device (or CPUs)
per rank, one RankProcess actor per bundle runs each rank, and a watcher thread re-places the
whole replica when any of its ranks is lost (a dead actor, a dead node, a rank that exited)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.config_args import config_json_argv
from services.ray.rank_process import RankProcess
from services.ray.spread import ReplicaSpread
from services.restart_budget import RestartBudget
from shared.config import EngineConfig

log = logging.getLogger("pagedserve.ray")
WAIT_S = 0.5  # how often a waiting watcher looks up to see whether the stack is stopping
PENDING_WARNING_S = 10.0  # a replica that cannot be placed for this long says so, once

_RankActor = ray.remote(max_restarts=0)(RankProcess)


@dataclasses.dataclass(frozen=True)
class RankResources:
    """What each rank reserves in its bundle."""

    cpus: float
    gpus: float

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


class RayReplica:
    def __init__(
        self,
        index: int,
        engine: EngineConfig,
        wires: list[str],
        env: dict[str, str],
        resources: RankResources,
        strategy: str,
        spread: ReplicaSpread,
        budget: RestartBudget,
        on_event: Callable[[str, RayReplica], None],
    ) -> None:
        self.index = index
        self.engine = engine
        self.wires = wires  # the scheduler's tcp:// endpoints, as executor flags
        self.env = env  # passed to every rank's process, on whichever node
        self.resources = resources
        self.strategy = strategy  # of the ranks within this replica's placement group
        self.spread = spread  # shared by the replicas: each keeps off the others' nodes
        self.budget = budget
        self.on_event = on_event  # ("placed" | "lost" | "given up", self), from the watcher
        self.nodes: list[str] = []  # node id per rank, once placed
        self.replacements = 0  # times the replica was placed again after a loss
        self.place_s: float | None = None  # what Ray's part of the last placement took
        self._group = None
        self._actors: list = []
        self._stopping = threading.Event()
        self._kill_now = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"replica-{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def recycle(self) -> None:
        """Stop the ranks (their scheduler was replaced); the watcher places new ones."""
        self._kill_now.set()

    def stop_watching(self) -> None:
        """From now on a rank that exits is not replaced (the stack is stopping)."""
        self._stopping.set()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(30)
        self._teardown()

    # ---- the watcher thread --------------------------------------------------------------------
    def _watch(self) -> None:
        first = True
        while not self._stopping.is_set():
            if not first and not self.budget.allow():
                log.error("replica %d lost with its budget (%s) spent", self.index,
                          self.budget.describe())  # fmt: skip
                self.on_event("given up", self)
                return
            try:
                done = self._place()
            except ray.exceptions.RayError as exc:  # a node lost while its ranks started
                log.error("replica %d: placing failed: %s", self.index, type(exc).__name__)
                self._teardown()
                self._stopping.wait(WAIT_S)  # not a tight loop while the cluster settles
                continue
            if done is None:
                return  # stopping
            if not first:
                self.replacements += 1
            self.on_event("placed", self)
            first = False
            self._wait_lost(done)
            if self._stopping.is_set():
                return
            self.on_event("lost", self)
            self._teardown()

    def _place(self) -> list | None:
        """Reserve the ranks' bundles (waiting for resources as long as it takes), start every
        rank; the liveness refs, or None when stopping first."""
        started = time.perf_counter()
        bundles = [self.resources.bundle()] * self.engine.parallel.tensor_parallel_size
        self._group = self.spread.reserve(self.index, bundles, self.strategy)
        reserved = self._group.ready()  # one ref: each ready() call submits a task
        waited = 0.0
        while not self._stopping.is_set():
            ready, _ = ray.wait([reserved], timeout=WAIT_S)
            if ready:
                break
            waited += WAIT_S
            if waited == PENDING_WARNING_S:
                log.warning("replica %d waits for the cluster to have room for %s (%s)",
                            self.index, bundles, self.strategy)  # fmt: skip
        else:
            return None
        self.spread.placed(self.index, self._group)
        self._actors = [
            _RankActor.options(
                num_cpus=self.resources.cpus,
                num_gpus=self.resources.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(len(bundles))
        ]
        nodes = ray.get([actor.node.remote() for actor in self._actors])
        self.nodes = [n["node_id"] for n in nodes]
        self.place_s = time.perf_counter() - started  # reserved, and every rank's actor up
        engine = self.engine
        if len(self._actors) > 1:
            # The rendezvous lives where rank 0 runs; the other ranks are started here, not by it.
            port = ray.get(self._actors[0].free_port.remote())
            parallel = dataclasses.replace(
                engine.parallel, master_addr=nodes[0]["ip"], master_port=port,
                external_workers=True,
            )  # fmt: skip
            engine = dataclasses.replace(engine, parallel=parallel)
        argv = [["-m", "services.executor", *config_json_argv(engine), *self.wires]]
        for rank in range(1, len(self._actors)):
            argv.append(
                ["-m", "services.executor.tp_worker", "--rank", str(rank),
                 *config_json_argv(engine)]
            )  # fmt: skip
        self._kill_now.clear()
        return [actor.run.remote(a, self.env) for actor, a in zip(self._actors, argv)]

    def _wait_lost(self, refs: list) -> None:
        """Until any rank ends (its process exited, its actor or node died) or stop/recycle."""
        while not self._stopping.is_set() and not self._kill_now.is_set():
            ready, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S)
            if ready:
                try:
                    code = ray.get(ready[0])
                    log.error("replica %d: a rank exited with code %s", self.index, code)
                except ray.exceptions.RayError as exc:
                    log.error("replica %d: a rank was lost: %s", self.index, type(exc).__name__)
                return

    def _teardown(self) -> None:
        # Every rank goes: the others wait in collectives the lost one will never join.
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        self.spread.forget(self.index)
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
