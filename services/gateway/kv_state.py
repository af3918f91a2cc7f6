"""The gateway's copy of the scheduler's block map: fetched on demand, shared by all pollers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.gateway.http_errors import ServiceUnavailableError
from shared.packed import unpack_ints
from shared.protocol import KvState

MIN_INTERVAL_S = 0.25  # however many dashboards poll, the scheduler builds at most 4 maps a second
TIMEOUT_S = 3.0


class KvStateCache:
    """At most one KvStateRequest in flight; a map younger than MIN_INTERVAL_S is reused."""

    def __init__(self, send_request: Callable[[], Awaitable[None]]) -> None:
        self._send_request = send_request
        self._latest: KvState | None = None
        self._received = 0.0
        self._pending: asyncio.Future[KvState] | None = None

    def deliver(self, state: KvState) -> None:
        self._latest, self._received = state, time.monotonic()
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(state)

    async def get(self) -> KvState:
        if self._latest is not None and time.monotonic() - self._received < MIN_INTERVAL_S:
            return self._latest
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_future()
            await self._send_request()
        try:
            return await asyncio.wait_for(asyncio.shield(self._pending), TIMEOUT_S)
        except TimeoutError:
            raise ServiceUnavailableError(
                "the scheduler did not send its block map", code="not_ready"
            ) from None


def kv_state_json(state: KvState) -> dict[str, Any]:
    """The record with its per-block arrays as lists, plus per-state block counts (the legend)."""
    refs = unpack_ints(state.device_ref_counts)
    cpu_refs = unpack_ints(state.cpu_ref_counts)
    requests = [dataclasses.asdict(r) for r in state.requests]
    statuses = [r.status for r in state.requests]
    num_free = refs.count(0)
    num_used = refs.count(1)
    return {
        "time": state.time,
        "block_size": state.block_size,
        "device_ref_counts": refs,
        "device_owners": unpack_ints(state.device_owners),
        "cpu_ref_counts": cpu_refs,
        "cpu_owners": unpack_ints(state.cpu_owners),
        "cached_block_ids": state.cached_block_ids,
        "requests": requests,
        "preemptions": [dataclasses.asdict(p) for p in state.preemptions],
        "num_preemptions": state.num_preemptions,
        "summary": {
            "num_device_blocks": len(refs),
            "num_cpu_blocks": len(cpu_refs),
            "device_free": num_free - len(state.cached_block_ids),
            "device_used": num_used,
            "device_shared": len(refs) - num_free - num_used,
            "device_cached": len(state.cached_block_ids),
            "cpu_used": len(cpu_refs) - cpu_refs.count(0),
            "num_running": statuses.count("running"),
            "num_waiting": statuses.count("waiting"),
            "num_swapped": statuses.count("swapped"),
        },
    }
