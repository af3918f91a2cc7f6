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


async def test_deltas_and_next_tokens_go_to_each_request_s_own_gateway(tmp_path):
    from shared.ipc import recv
    from shared.protocol import NextTokens, RequestDelta, SeqDelta

    address = Addresses.ipc(str(tmp_path / "ipc")).gateway
    ctx = zmq.asyncio.Context()
    router = make_socket(ctx, zmq.ROUTER, address, bind=True)
    links = GatewayLinks(router, lambda ids: None)
    try:
        a = make_socket(ctx, zmq.DEALER, address, bind=False)
        b = make_socket(ctx, zmq.DEALER, address, bind=False)
        peers = {}
        for name, sock in (("a", a), ("b", b)):
            await send(sock, GatewayHello())
            peers[name], _ = await links.recv()
        for request_id in ("a1", "a2", "a3"):
            links.own(peers["a"], request_id)
        links.own(peers["b"], "b1")
        ends = RequestDelta("a3", [SeqDelta(0, [9], [], "stop")], True)
        plain = NextTokens()
        for request_id, token in (("a1", 5), ("b1", 6), ("gone", 7), ("a2", 8)):
            plain.add(request_id, token, 4)
        await links.send_deltas([ends], STATS, plain)
        to_a, to_b = await recv(a), await recv(b)
        assert to_a.deltas == [ends]
        assert to_a.next_tokens == NextTokens(["a1", "a2"], [5, 8], [4, 4])
        assert to_b.deltas == [] and to_b.next_tokens == NextTokens(["b1"], [6], [4])
        assert to_b.next_tokens.delta(0) == RequestDelta("b1", [SeqDelta(0, [6])], False, None, 4)
        # a3 ended: released; the plain requests stay a's.
        await links.send_deltas([], STATS, NextTokens(["a3", "a1"], [1, 2], [4, 4]))
        assert (await recv(a)).next_tokens == NextTokens(["a1"], [2], [4])
    finally:
        ctx.destroy(linger=0)
