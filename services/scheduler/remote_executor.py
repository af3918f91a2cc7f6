"""The executor process as the engine core's ExecutorLink: plans out over ZeroMQ, results,
heartbeats and announcements back, and the liveness those give."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from shared.ipc import Addresses, make_socket, recv, send
from shared.peer_watch import PeerWatch
from shared.protocol import ExecutorHeartbeat, ExecutorReady, StepPlan, StepResult

log = logging.getLogger("pagedserve.scheduler")
HEARTBEAT_S = 1.0
EXECUTOR_TIMEOUT_S = 10.0  # no executor heartbeat for this long: it is gone


class ExecutorLost(Exception):
    """The executor's connection closed: its process died (a new one is on its way)."""


class RemoteExecutor:
    def __init__(self, ctx: zmq.asyncio.Context, addresses: Addresses) -> None:
        self.plans = make_socket(ctx, zmq.PUSH, addresses.plans, bind=True)
        self.results = make_socket(ctx, zmq.PULL, addresses.results, bind=True)
        self.up = True  # False from its loss until a new one has announced itself
        self._seen = time.monotonic()
        # step_id -> the result's future, for plans in flight
        self._in_flight: dict[int, asyncio.Future[StepResult]] = {}

    def watch(self, on_lost: Callable[[], None]) -> PeerWatch:
        """Call before anyone connects, so that every peer is counted."""
        return PeerWatch(self.plans, on_lost)

    def alive(self) -> bool:
        return time.monotonic() - self._seen < EXECUTOR_TIMEOUT_S

    async def wait_ready(self) -> ExecutorReady:
        while True:
            message = await self.receive()
            if isinstance(message, ExecutorReady):
                return message

    async def receive(self) -> object:
        """The executor's next message that is neither a heartbeat nor a step's result: those
        only refresh liveness and end their step."""
        while True:
            message = await recv(self.results)
            self._seen = time.monotonic()
            if isinstance(message, StepResult):
                # A result that arrives after its step was given up on must not end another.
                future = self._in_flight.get(message.step_id)
                if future is not None and not future.done():
                    future.set_result(message)
                elif future is None:
                    log.warning("dropped a late result for step %d", message.step_id)
            elif not isinstance(message, ExecutorHeartbeat):
                return message

    async def launch(self, plan: StepPlan) -> int:
        """Send a plan; its result arrives through receive(). A send to a dead executor would
        wait forever, so it is bounded; a silent executor fails the step. Raises ExecutorLost
        when the executor's connection closes meanwhile."""
        future = asyncio.get_running_loop().create_future()
        self._in_flight[plan.step_id] = future
        while True:
            if not self.up:
                raise ExecutorLost()
            try:
                await asyncio.wait_for(send(self.plans, plan), HEARTBEAT_S)
                return plan.step_id
            except TimeoutError:
                if not self.alive():
                    future.set_result(_no_response(plan.step_id))
                    return plan.step_id

    async def collect(self, step_id: int) -> StepResult:
        """The step's result; raises ExecutorLost like launch()."""
        future = self._in_flight[step_id]
        try:
            while True:
                if not self.up:
                    raise ExecutorLost()
                try:
                    return await asyncio.wait_for(asyncio.shield(future), HEARTBEAT_S)
                except TimeoutError:
                    if not self.alive():
                        return _no_response(step_id)
        finally:
            del self._in_flight[step_id]
            if future.done() and not future.cancelled():
                future.exception()  # retrieved (an ExecutorLost we raised ourselves)

    async def send(self, message: object, timeout_s: float = HEARTBEAT_S) -> bool:
        """Send anything but a plan beside the plans; False when the executor did not take it
        in time (one that reads no plans is dying)."""
        try:
            await asyncio.wait_for(send(self.plans, message), timeout_s)
            return True
        except TimeoutError:
            return False

    def lose(self) -> None:
        """Its connection closed: fail every step in flight (the core then forgets them)."""
        self.up = False
        for future in self._in_flight.values():
            if not future.done():
                future.set_exception(ExecutorLost())

    def forget(self) -> None:
        """Drop the steps that died with the executor."""
        for future in self._in_flight.values():
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: not an unhandled error
        self._in_flight.clear()

    def back(self) -> None:
        """A new executor has announced itself and the scheduler has requeued onto it."""
        self._seen = time.monotonic()
        self.up = True


def _no_response(step_id: int) -> StepResult:
    """A step failed for want of an answer: its requests end with an error instead of hanging."""
    log.error("executor stopped responding; failing step %d", step_id)
    return StepResult(step_id, [], error="the executor stopped responding")
