"""Several scheduler+executor stacks behind one gateway: route each request to the least loaded.

Load is the tokens a replica still owes: for every request routed to it and not yet finished,
its prompt plus max_tokens for each sample, as counted at submission. A replica that is not
ready (its heartbeat is stale or its executor is gone) gets no new request; its open streams
end as they would with one backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.gateway.backend import BackendGone
from shared.protocol import GenerateRequest, RequestDelta, SchedulerReady, SchedulerStats


class ReplicaRouter:
    def __init__(self, replicas: list[Any]) -> None:
        self.replicas = replicas  # ZmqBackend-like objects, index = replica id
        self.outstanding = [0] * len(replicas)  # tokens owed, per replica
        self.routed = [0] * len(replicas)  # requests sent, per replica
        self.on_route: Callable[[int], None] | None = None  # /metrics counts each routing
        self._owner: dict[str, int] = {}

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.close()

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    @property
    def degraded(self) -> bool:
        """Serving, but with some replica down."""
        return self.ready and not all(r.ready for r in self.replicas)

    @property
    def info(self) -> SchedulerReady | None:
        ready = [r.info for r in self.replicas if r.ready and r.info is not None]
        known = ready or [r.info for r in self.replicas if r.info is not None]
        if not known:
            return None
        # Requests must fit every replica they might be routed to.
        return dataclasses.replace(known[0], max_num_seqs=min(i.max_num_seqs for i in known))

    @property
    def stats(self) -> SchedulerStats | None:
        """Sums over the replicas (gauges of the whole service); per replica: replica_table."""
        stats = [r.stats for r in self.replicas if r.stats is not None]
        if not stats:
            return None
        summed = {
            f.name: sum(getattr(s, f.name) for s in stats)
            for f in dataclasses.fields(SchedulerStats)
            if f.type in ("int", int)
        }
        return SchedulerStats(
            **summed,
            executor_alive=all(s.executor_alive for s in stats),
            executor_restarting=any(s.executor_restarting for s in stats),
        )

    @property
    def num_in_transit(self) -> int:
        return sum(getattr(r, "num_in_transit", 0) for r in self.replicas)

    def replica_table(self) -> list[tuple[bool, int, int, SchedulerStats | None]]:
        """Per replica: (ready, requests routed, tokens owed, latest stats), for /metrics."""
        return [
            (r.ready, self.routed[i], self.outstanding[i], r.stats)
            for i, r in enumerate(self.replicas)
        ]

    def pick(self) -> int:
        """The ready replica that owes the fewest tokens (lowest index on ties)."""
        ready = [i for i, r in enumerate(self.replicas) if r.ready]
        if not ready:
            raise BackendGone("no model replica is ready")
        return min(ready, key=lambda i: (self.outstanding[i], i))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        index = self.pick()
        cost = len(request.prompt_token_ids) + (
            request.sampling.max_tokens * request.sampling.num_samples
        )
        self.outstanding[index] += cost
        self.routed[index] += 1
        if self.on_route is not None:
            self.on_route(index)
        self._owner[request.request_id] = index
        try:
            async for delta in self.replicas[index].generate(request):
                if delta.finished:
                    self._owner.pop(request.request_id, None)
                yield delta
        finally:
            self.outstanding[index] -= cost
        # Unfinished here: the owner stays known, since the caller's abort() may come later.

    async def abort(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            await self.replicas[index].abort(request_id)

    def fail_all(self, reason: str) -> None:
        for replica in self.replicas:
            replica.fail_all(reason)

    async def kv_state(self) -> Any:
        """The block map of the first ready replica (the dashboard shows one pool)."""
        for replica in self.replicas:
            if replica.ready:
                return await replica.kv_state()
        raise BackendGone("no model replica is ready")
