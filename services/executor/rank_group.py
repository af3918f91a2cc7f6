"""The tensor-parallel ranks as rank 0 sees them (start the local ones, hand each plan to all,
notice when the group can no longer go on) and as the others do (receive the next plan)."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys

import torch

from services.executor.tensor_parallel import Shard, broadcast_bytes, init_group, open_store
from shared import wire
from shared.config import EngineConfig
from shared.protocol import StepPlan


class RankGroup:
    def __init__(self, config: EngineConfig, rank: int, device: torch.device) -> None:
        self.workers: list[subprocess.Popen] = []  # ranks this process started
        # True once a step failed on this rank: the other ranks may wait in a collective it
        # will never issue, so the group is out of step for good.
        self.broken = False
        # Plans travel between ranks as tensors on the collective backend's device.
        self._comm_device = device if device.type == "cuda" else torch.device("cpu")
        size = config.parallel.tensor_parallel_size
        self.shard = self._join(config, rank, device) if size > 1 else Shard()

    def _join(self, config: EngineConfig, rank: int, device: torch.device) -> Shard:
        parallel = config.parallel
        store = None
        if rank == 0:
            # Rank 0 binds the rendezvous itself, on port 0 unless one is set (the kernel picks
            # it), before any other rank starts: no process can take the port in between.
            store = open_store(
                parallel.master_addr, parallel.master_port or 0, parallel.tensor_parallel_size,
                is_master=True,
            )  # fmt: skip
            if parallel.master_port is None:
                parallel = dataclasses.replace(parallel, master_port=store.port)
                config = dataclasses.replace(config, parallel=parallel)
        if rank == 0 and not parallel.external_workers:
            for other in range(1, parallel.tensor_parallel_size):
                self.workers.append(_spawn_rank(config, other))
            atexit.register(self.close)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return init_group(
            rank, parallel.tensor_parallel_size, parallel.master_addr, parallel.master_port,
            device.type, store=store,
        )  # fmt: skip

    def alive(self) -> bool:
        """False once a locally started rank has exited or a step failed on this rank (the
        ranks' collectives can no longer be matched): the executor cannot go on."""
        return not self.broken and all(worker.poll() is None for worker in self.workers)

    def send_plan(self, plan: StepPlan) -> None:
        """Rank 0: every other rank runs the same plan."""
        broadcast_bytes(self.shard, wire.encode(plan), self._comm_device)

    def next_plan(self) -> StepPlan | None:
        """Ranks 1..: the plan rank 0 sends next, or None when it stops the group."""
        payload = broadcast_bytes(self.shard, None, self._comm_device)
        return wire.decode(payload) if payload else None

    def close(self) -> None:
        """Rank 0: stop the other ranks (idempotent)."""
        if self.shard.size == 1 or not self.shard.is_driver:
            return
        if not torch.distributed.is_initialized():
            return
        healthy = self.alive()
        if healthy:
            broadcast_bytes(self.shard, b"", self._comm_device)
        for worker in self.workers:
            if not healthy:  # it may be waiting in a collective that will never complete
                worker.kill()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        torch.distributed.destroy_process_group()


def _spawn_rank(config: EngineConfig, rank: int) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "services.executor.tp_worker", "--rank", str(rank),
        "--config-json", json.dumps(config.to_dict()), "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    return subprocess.Popen(argv)
