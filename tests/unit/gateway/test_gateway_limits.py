"""Gateway limits against a fake backend: request timeout, Retry-After, exact in-transit count."""

from __future__ import annotations

import pytest

from services.gateway.http_errors import RateLimitError
from services.gateway.state import GatewayState
from tests.support.gateway_fakes import completion, parse_sse
from tests.support.polling import eventually


async def test_a_request_over_the_timeout_ends_with_a_timeout_error_and_is_aborted(serve) -> None:
    client, backend = await serve(request_timeout_s=0.3)
    backend.hold_first = True  # queued at the scheduler and never started
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 408
    error = (await resp.json())["error"]
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
    assert "0.3 s" in error["message"]
    await eventually(lambda: backend.aborted == [backend.requests[0].request_id])


async def test_a_stream_over_the_timeout_ends_with_an_error_event(serve) -> None:
    client, backend = await serve(request_timeout_s=0.5)
    backend.delay = 0.2  # a token every 0.2 s, 5 tokens: 1 s in all
    resp = await client.post("/v1/completions", json=completion(stream=True))
    assert resp.status == 200
    events = parse_sse(await resp.text())
    assert 1 <= len(events) - 1 <= 3  # a few tokens, then the error
    assert events[-1]["error"]["code"] == "request_timeout"
    await eventually(lambda: len(backend.aborted) == 1)


async def test_a_request_within_the_timeout_is_untouched(serve) -> None:
    client, backend = await serve(request_timeout_s=5.0)
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 200 and backend.aborted == []


async def test_429_and_503_carry_retry_after(serve) -> None:
    client, backend = await serve(max_queued_requests=1)
    backend.current_stats.num_waiting = 1
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    backend.is_ready = False
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"


class _Stats:
    num_waiting = 3


class _AckingBackend:
    stats = _Stats()
    num_in_transit = 1


def test_the_queue_counts_a_backends_exact_in_transit_figure():
    # Four requests handed to the handlers have no first delta yet, but the backend has already
    # taken the acks of three of them into num_waiting: 3 waiting + 1 in transit, not 3 + 4.
    state = GatewayState(_AckingBackend(), None, None, None, max_queued_requests=5)
    state.num_unstarted = 4
    state.check_queue()  # 4 < 5: admitted
    state.max_queued_requests = 4
    with pytest.raises(RateLimitError):
        state.check_queue()


async def test_a_prompt_too_long_to_fit_is_refused_before_tokenization(serve, tokenizer) -> None:
    client, backend = await serve()
    calls = []
    original = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        huge = "x" * 5_000_000
        for path, body in [
            ("/v1/completions", completion(prompt=huge)),
            (
                "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": huge}]},
            ),
            ("/v1/tokenize", {"model": "tiny", "prompt": huge}),
        ]:
            resp = await client.post(path, json=body)
            assert resp.status == 400, path
            assert (await resp.json())["error"]["code"] == "context_length_exceeded"
        assert calls == [] and backend.requests == []
    finally:
        tokenizer.encode = original


async def test_oversized_bodies_and_headers_are_refused(serve) -> None:
    client, backend = await serve()
    resp = await client.post(
        "/v1/completions",
        data=b"x" * (33 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
    )
    assert resp.status == 413
    assert (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await client.get("/health", headers={"X-Big": "y" * 20_000})
    assert resp.status in (400, 431)
    assert (await client.get("/health")).status == 200  # still serving
