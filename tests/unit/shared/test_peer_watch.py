"""PeerWatch counts the processes connected to a socket from its monitor events, and reports a
loss only when none is left once every event already queued is counted."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from shared.peer_watch import PeerWatch
from tests.support.polling import eventually

# Long enough for the I/O thread to queue a connection's event after the call that makes it.
EVENT_QUEUED_S = 0.5


def _pull(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.connect(address)
    return sock


async def test_a_peer_replaced_before_the_watch_reads_its_events_is_not_lost():
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    losses: list[str] = []
    watch = PeerWatch(push, lambda: losses.append("lost"))
    address = f"tcp://127.0.0.1:{push.bind_to_random_port('tcp://127.0.0.1')}"
    task = None
    try:
        # The old peer joins and leaves, then the new one joins, all before the watch reads an
        # event: a scheduler starting while the launcher replaces the executor.
        old = _pull(ctx, address)
        await asyncio.sleep(EVENT_QUEUED_S)
        old.close(linger=0)
        await asyncio.sleep(EVENT_QUEUED_S)
        new = _pull(ctx, address)
        await asyncio.sleep(EVENT_QUEUED_S)
        task = asyncio.create_task(watch.run())
        await eventually(lambda: watch.num_peers == 1, timeout=10.0)
        await asyncio.sleep(EVENT_QUEUED_S)
        assert losses == []  # its leave had a join queued behind it

        new.close(linger=0)  # the last peer goes: that is a loss
        await eventually(lambda: losses == ["lost"], timeout=10.0)
        assert watch.num_peers == 0
    finally:
        if task is not None:
            task.cancel()
        ctx.destroy(linger=0)
