"""A stand-in scheduler for gateway-side tests: the ROUTER end of the gateway pipe, with a
ZmqBackend connected to it and made ready (announcement and stats sent)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from services.gateway.zmq_backend import ZmqBackend
from shared.ipc import Addresses, make_socket, recv_from, send_to
from shared.protocol import (
    ExecutorReady,
    GatewayHello,
    GenerateRequest,
    SchedulerReady,
    SchedulerStats,
    TokenDeltas,
)
from tests.support.polling import eventually

READY = SchedulerReady(ExecutorReady(64, 0, 16, 512, 384, (2,)), 16, "tiny")
STATS = SchedulerStats(1, 0, 0, 1, 64, 0, 1)


@dataclass
class StandIn:
    backend: ZmqBackend
    router: zmq.asyncio.Socket
    gateway: bytes  # the backend's identity on the ROUTER

    async def send(self, message: Any) -> None:
        assert await send_to(self.router, self.gateway, message)

    async def next_request(self) -> GenerateRequest:
        """The next GenerateRequest, past any further hello (the connection's join event)."""
        while True:
            _, message = await recv_from(self.router)
            if isinstance(message, GenerateRequest):
                return message


@contextlib.asynccontextmanager
async def stand_in_scheduler(directory: str) -> AsyncIterator[StandIn]:
    addresses = Addresses.ipc(directory)
    ctx = zmq.asyncio.Context()
    router = make_socket(ctx, zmq.ROUTER, addresses.gateway, bind=True)
    backend = ZmqBackend(addresses)
    await backend.start()
    try:
        gateway, hello = await recv_from(router)
        assert isinstance(hello, GatewayHello)
        stand_in = StandIn(backend, router, gateway)
        await stand_in.send(TokenDeltas([], STATS))
        await stand_in.send(READY)
        await eventually(lambda: backend.ready, 10.0, message="the backend never got ready")
        yield stand_in
    finally:
        await backend.close()
        ctx.destroy(linger=0)
