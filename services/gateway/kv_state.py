"""The gateway's copy of the scheduler's block map: fetched on demand, shared by all pollers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.gateway.http_errors import ServiceUnavailableError
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
    """The wire record plus per-state block counts (what the grid's legend shows)."""
    body = dataclasses.asdict(state)
    refs = state.device_ref_counts
    body["summary"] = {
        "num_device_blocks": len(refs),
        "num_cpu_blocks": len(state.cpu_ref_counts),
        "device_free": sum(1 for r in refs if r == 0) - len(state.cached_block_ids),
        "device_used": sum(1 for r in refs if r == 1),
        "device_shared": sum(1 for r in refs if r > 1),
        "device_cached": len(state.cached_block_ids),
        "cpu_used": sum(1 for r in state.cpu_ref_counts if r > 0),
        "num_running": sum(1 for r in state.requests if r.status == "running"),
        "num_waiting": sum(1 for r in state.requests if r.status == "waiting"),
        "num_swapped": sum(1 for r in state.requests if r.status == "swapped"),
    }
    return body
