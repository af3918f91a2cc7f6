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
from shared.peer_watch import PeerWatch
from shared.protocol import NextTokens, RequestDelta, SchedulerStats, TokenDeltas


class GatewayLinks:
    def __init__(self, sock: zmq.asyncio.Socket, on_gone: Callable[[list[str]], None]) -> None:
        self.sock = sock
        self._on_gone = on_gone
        self._open: dict[bytes, set[str]] = {}  # every gateway heard from -> its open requests
        self._owner: dict[str, bytes] = {}  # open request id -> its gateway
        self._send_lock = asyncio.Lock()
        self._probes: set[asyncio.Task] = set()

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

    async def send_deltas(
        self,
        deltas: list[RequestDelta],
        stats: SchedulerStats,
        next_tokens: NextTokens | None = None,
    ) -> None:
        """One TokenDeltas per gateway with deltas this step; a finished request is released.
        next_tokens' requests go on (none is finished): each goes to its gateway's columns."""
        by_peer: dict[bytes, TokenDeltas] = {}
        for delta in deltas:
            peer = self._owner.get(delta.request_id)
            if peer is None:  # its gateway left (the request was aborted then)
                continue
            if peer not in by_peer:
                by_peer[peer] = TokenDeltas([], stats)
            by_peer[peer].deltas.append(delta)
            if delta.finished:
                del self._owner[delta.request_id]
                self._open[peer].discard(delta.request_id)
        if next_tokens is not None:
            owner = self._owner
            for i, request_id in enumerate(next_tokens.request_ids):
                peer = owner.get(request_id)
                if peer is None:
                    continue
                message = by_peer.get(peer)
                if message is None:
                    message = by_peer[peer] = TokenDeltas([], stats)
                if message.next_tokens is None:
                    message.next_tokens = NextTokens()
                message.next_tokens.add(
                    request_id, next_tokens.token_ids[i], next_tokens.num_prompt_tokens[i]
                )
        for peer, message in by_peer.items():
            await self.send(peer, message)

    def watch(self, stats: Callable[[], SchedulerStats | None]) -> PeerWatch:
        """The socket's connection monitor: when any gateway's connection closes, a stats
        message to every gateway finds which one left (the send to it fails). Not the
        monitor's count of peers: it misses connections made before it was attached. The
        heartbeat's broadcast probes too, in case this one comes before the socket has
        dropped the closed connection."""

        def probe() -> None:
            now = stats()
            if now is not None:
                task = asyncio.ensure_future(self.broadcast(TokenDeltas([], now)))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

        return PeerWatch(self.sock, None, on_left=probe)

    async def broadcast(self, message: Any) -> None:
        """To every known gateway; doubles as a probe, since a gone one fails the send."""
        for peer in list(self._open):
            await self.send(peer, message)

    def _drop(self, peer: bytes) -> None:
        if peer not in self._open:  # found gone twice (a probe and a heartbeat at once)
            return
        request_ids = self._open.pop(peer)
        for request_id in request_ids:
            self._owner.pop(request_id, None)
        self._on_gone(sorted(request_ids))
