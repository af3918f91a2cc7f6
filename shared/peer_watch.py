"""Who is connected at the other end of a ZeroMQ socket, from its monitor events: a peer process
that dies closes its connection, so its loss is seen at once rather than after missed beats."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

_JOINED = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED
_LEFT = zmq.EVENT_DISCONNECTED


class PeerWatch:
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        on_lost: Callable[[], None] | None,
        on_joined: Callable[[], None] | None = None,
        on_left: Callable[[], None] | None = None,
    ) -> None:
        """on_lost: the last peer left; on_left: any peer left (some may remain). The count
        misses peers that connected before the monitor was attached: where that matters,
        treat a loss as a hint and check (the scheduler probes its gateways on every leave)."""
        self.num_peers = 0
        self._on_lost = on_lost
        self._on_joined = on_joined
        self._on_left = on_left
        self._monitor = sock.get_monitor_socket(_JOINED | _LEFT)

    async def run(self) -> None:
        while True:
            left = self._count(await self._monitor.recv_multipart())
            # Events already queued behind this one first: a process replaced while this side
            # was busy (starting up, say) has its predecessor's leave queued before its own
            # join, and the peer count is only right after both.
            while await self._monitor.poll(timeout=0):
                left |= self._count(await self._monitor.recv_multipart())
            if left and self.num_peers == 0 and self._on_lost is not None:
                self._on_lost()

    def _count(self, frames: list[bytes]) -> bool:
        """Counts one monitor event; whether a peer left."""
        event = parse_monitor_message(frames)["event"]
        if event & _JOINED:
            self.num_peers += 1
            if self._on_joined is not None:
                self._on_joined()
            return False
        if event & _LEFT:
            self.num_peers = max(0, self.num_peers - 1)
            if self._on_left is not None:
                self._on_left()
            return True
        return False
