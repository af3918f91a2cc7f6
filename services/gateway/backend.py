"""The gateway's view of the scheduler: submit requests, stream their deltas, abort, readiness.

`Backend` is the interface the HTTP layer uses; `ZmqBackend` speaks to a scheduler process over
ZeroMQ. Tests of the HTTP layer substitute a fake with the same methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from shared.protocol import GenerateRequest, RequestDelta, SchedulerReady, SchedulerStats


class BackendGone(RuntimeError):
    """The scheduler (or the executor behind it) stopped answering; in-flight requests end."""


class Backend(Protocol):
    @property
    def ready(self) -> bool:
        """Both backend processes are up and the scheduler's heartbeat is fresh."""

    @property
    def info(self) -> SchedulerReady | None:
        """Model limits and pool sizes, once the scheduler has announced them."""

    @property
    def stats(self) -> SchedulerStats | None:
        """The scheduler's latest gauges and counters."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Submit and yield the request's deltas; the last one has finished=True.

        Raises BackendGone if the backend dies first. Closing the iterator early (client gone)
        does not abort: call abort() for that.
        """

    async def abort(self, request_id: str) -> None:
        """End the request at the scheduler and free its blocks (no-op if already finished)."""
