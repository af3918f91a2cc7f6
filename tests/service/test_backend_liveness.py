"""The gateway's ZeroMQ backend ends open streams when the scheduler falls silent (no timer per
token: a once-a-second liveness check does it), and not while it keeps beating."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway import zmq_backend
from services.gateway.backend import BackendGone
from shared.protocol import GenerateRequest, RequestDelta, TokenDeltas
from shared.sampling import SamplingParams
from tests.service.stand_in_scheduler import STATS, stand_in_scheduler


@pytest.fixture
def fast_liveness(monkeypatch):
    monkeypatch.setattr(zmq_backend, "HEARTBEAT_TIMEOUT_S", 0.6)
    monkeypatch.setattr(zmq_backend, "LIVENESS_CHECK_S", 0.1)


async def _stream_until_silence(tmp_path, beat_for_s: float) -> tuple[float, float]:
    """A stand-in scheduler acknowledges one request, beats for beat_for_s, then falls silent
    (its connection stays open). Returns (seconds until the stream ended, silence start)."""
    async with stand_in_scheduler(str(tmp_path / "ipc")) as stand_in:
        request = GenerateRequest("r1", [5, 6], SamplingParams(max_tokens=4), time.time())

        async def consume() -> None:
            async for _ in stand_in.backend.generate(request):
                pass

        stream = asyncio.ensure_future(consume())
        await stand_in.next_request()
        await stand_in.send(TokenDeltas([RequestDelta("r1", [], False)], STATS))
        start = time.monotonic()
        while time.monotonic() - start < beat_for_s:
            await stand_in.send(TokenDeltas([], STATS))
            await asyncio.sleep(0.1)
            assert not stream.done()  # beating: the stream waits, however long
        silent_at = time.monotonic() - start
        # Ended by the liveness check ("stopped responding"), not by the test's limit: 5 s, many
        # times the 0.6 s timeout plus a 0.1 s check, so that a loaded machine still makes it.
        with pytest.raises(BackendGone, match="stopped responding"):
            await asyncio.wait_for(stream, 5.0)
        return time.monotonic() - start, silent_at


async def test_a_silent_scheduler_ends_the_open_streams(tmp_path, fast_liveness):
    ended, silent_at = await _stream_until_silence(tmp_path, beat_for_s=1.5)
    # Not before the heartbeat timeout ran out after the last beat (a lower bound, which a slow
    # machine cannot break); how soon after is bounded above only by the generous wait_for.
    assert silent_at + 0.3 <= ended
