"""The scheduler's side of its gateways: one ROUTER socket that any number of gateway processes
connect to (each with a DEALER).

Every request belongs to the gateway that sent it, and its deltas go back to that gateway
alone, so N gateways share the HTTP work of one scheduler without seeing each other's tokens.
A gateway that leaves (its connection closes, or a send finds it gone) has its open requests
handed to `on_gone`: nobody reads their tokens any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from shared.ipc import recv_from, send_to
from shared.protocol import RequestDelta, SchedulerStats, TokenDeltas


class GatewayLinks:
    def __init__(self, sock: zmq.asyncio.Socket, on_gone: Callable[[list[str]], None]) -> None:
        self.sock = sock
        self._on_gone = on_gone
        self._open: dict[bytes, set[str]] = {}  # every gateway heard from -> its open requests
        self._owner: dict[str, bytes] = {}  # open request id -> its gateway
        self._send_lock = asyncio.Lock()

    @property
    def num_gateways(self) -> int:
        return len(self._open)

    async def recv(self) -> tuple[bytes, Any]:
        """(the gateway, its message); raises ValueError (WireError) for a malformed one."""
        peer, message = await recv_from(self.sock)
        self._open.setdefault(peer, set())
        return peer, message

    def own(self, peer: bytes, request_id: str) -> None:
        """`request_id` was accepted from `peer`: its deltas go there until it finishes."""
        self._owner[request_id] = peer
        self._open.setdefault(peer, set()).add(request_id)

    async def send(self, peer: bytes, message: Any) -> None:
        async with self._send_lock:
            delivered = await send_to(self.sock, peer, message)
        if not delivered:
            self._drop(peer)

    async def send_deltas(self, deltas: list[RequestDelta], stats: SchedulerStats) -> None:
        """One TokenDeltas per gateway with deltas this step; a finished request is released."""
        by_peer: dict[bytes, list[RequestDelta]] = {}
        for delta in deltas:
            peer = self._owner.get(delta.request_id)
            if peer is None:  # its gateway left (the request was aborted then)
                continue
            by_peer.setdefault(peer, []).append(delta)
            if delta.finished:
                del self._owner[delta.request_id]
                self._open[peer].discard(delta.request_id)
        for peer, own in by_peer.items():
            await self.send(peer, TokenDeltas(own, stats))

    async def broadcast(self, message: Any) -> None:
        """To every known gateway; doubles as a probe, since a gone one fails the send."""
        for peer in list(self._open):
            await self.send(peer, message)

    def drop_all(self) -> None:
        """No gateway is connected any more (the socket's last peer left)."""
        for peer in list(self._open):
            self._drop(peer)

    def _drop(self, peer: bytes) -> None:
        request_ids = self._open.pop(peer, set())
        for request_id in request_ids:
            self._owner.pop(request_id, None)
        self._on_gone(sorted(request_ids))
