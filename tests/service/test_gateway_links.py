"""The scheduler's gateway links: a gateway that leaves loses its own requests and no others,
also when the connection monitor never counted some gateway (it connected first)."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from services.scheduler.gateway_links import GatewayLinks
from shared.ipc import Addresses, make_socket, send
from shared.protocol import GatewayHello, TokenDeltas
from tests.service.stand_in_scheduler import STATS
from tests.support.polling import eventually


async def test_a_leaving_gateway_is_found_by_a_probe_not_by_the_peer_count(tmp_path):
    address = Addresses.ipc(str(tmp_path / "ipc")).gateway
    ctx = zmq.asyncio.Context()
    aborted: list[str] = []
    router = make_socket(ctx, zmq.ROUTER, address, bind=True)
    links = GatewayLinks(router, aborted.extend)
    try:
        a = make_socket(ctx, zmq.DEALER, address, bind=False)  # before the monitor: uncounted
        await send(a, GatewayHello())
        peer_a, _ = await links.recv()
        links.own(peer_a, "req-of-a")

        watching = asyncio.ensure_future(links.watch(lambda: STATS).run())
        b = make_socket(ctx, zmq.DEALER, address, bind=False)
        await send(b, GatewayHello())
        peer_b, _ = await links.recv()
        links.own(peer_b, "req-of-b")
        b.close(linger=0)
        # The leave's probe ends b's link, or else the heartbeat's a second later does.
        with contextlib.suppress(AssertionError):
            await eventually(lambda: aborted, 2.0, 0.05)
        if not aborted:
            await links.broadcast(TokenDeltas([], STATS))  # as the heartbeat does
        assert aborted == ["req-of-b"]
        assert links.num_gateways == 1  # a is still served
        watching.cancel()
    finally:
        ctx.destroy(linger=0)
