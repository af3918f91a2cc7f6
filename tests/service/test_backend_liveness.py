"""The gateway's ZeroMQ backend ends open streams when the scheduler falls silent (no timer per
token: a once-a-second liveness check does it), and not while it keeps beating."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from services.gateway import zmq_backend
from services.gateway.backend import BackendGone
from services.gateway.zmq_backend import ZmqBackend
from shared.ipc import Addresses, make_socket, recv_from, send_to
from shared.protocol import (
    ExecutorReady,
    GatewayHello,
    GenerateRequest,
    RequestDelta,
    SchedulerReady,
    SchedulerStats,
    TokenDeltas,
)
from shared.sampling import SamplingParams

READY = SchedulerReady(ExecutorReady(64, 0, 16, 512, 384, (2,)), 16, "tiny")
STATS = SchedulerStats(1, 0, 0, 1, 64, 0, 1)


@pytest.fixture
def fast_liveness(monkeypatch):
    monkeypatch.setattr(zmq_backend, "HEARTBEAT_TIMEOUT_S", 0.6)
    monkeypatch.setattr(zmq_backend, "LIVENESS_CHECK_S", 0.1)


async def _stream_until_silence(tmp_path, beat_for_s: float) -> tuple[float, float]:
    """A stand-in scheduler acknowledges one request, beats for beat_for_s, then falls silent
    (its connection stays open). Returns (seconds until the stream ended, silence start)."""
    addresses = Addresses.ipc(str(tmp_path / "ipc"))
    ctx = zmq.asyncio.Context()
    router = make_socket(ctx, zmq.ROUTER, addresses.gateway, bind=True)
    backend = ZmqBackend(addresses)
    await backend.start()
    try:
        gateway, hello = await recv_from(router)
        assert isinstance(hello, GatewayHello)

        async def send(message) -> None:
            assert await send_to(router, gateway, message)

        await send(TokenDeltas([], STATS))
        await send(READY)
        while not backend.ready:
            await asyncio.sleep(0.01)
        request = GenerateRequest("r1", [5, 6], SamplingParams(max_tokens=4), time.time())

        async def consume() -> None:
            async for _ in backend.generate(request):
                pass

        stream = asyncio.ensure_future(consume())
        while not isinstance((await recv_from(router))[1], GenerateRequest):
            pass  # a second hello: the connection's join event
        await send(TokenDeltas([RequestDelta("r1", [], False)], STATS))
        start = time.monotonic()
        while time.monotonic() - start < beat_for_s:
            await send(TokenDeltas([], STATS))
            await asyncio.sleep(0.1)
            assert not stream.done()  # beating: the stream waits, however long
        silent_at = time.monotonic() - start
        with pytest.raises(BackendGone, match="stopped responding"):
            await asyncio.wait_for(stream, 5.0)
        return time.monotonic() - start, silent_at
    finally:
        await backend.close()
        ctx.destroy(linger=0)


async def test_a_silent_scheduler_ends_the_open_streams(tmp_path, fast_liveness):
    ended, silent_at = await _stream_until_silence(tmp_path, beat_for_s=1.5)
    # Not before the heartbeat timeout ran out after the last beat; soon after it.
    assert silent_at + 0.3 <= ended <= silent_at + 0.6 + 1.0
