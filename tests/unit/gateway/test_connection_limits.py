"""Slow and idle clients over raw sockets against the gateway's listener (the real runner and
connection guard, in this process, on a fake backend): each is answered 408 or closed once its
limit runs out while other clients are served, and connections past the cap are refused."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from services.gateway.app import STATE, create_app
from services.gateway.connection_guard import ConnectionGuard
from services.gateway.http_server import ConnectionLimits, listen, make_runner
from tests.support.gateway_fakes import FakeBackend
from tests.support.polling import eventually

MARGIN_S = 5.0  # generous: the outcome matters, not the exact time
NEVER_S = 3600.0  # a limit that does not run out during a test
# Either timer alone: aiohttp's keep-alive timer closes a head that never completes too.
HEAD_TIMER_ONLY = {"header_read_timeout_s": 1.0, "keepalive_timeout_s": NEVER_S}
KEEPALIVE_ONLY = {"header_read_timeout_s": NEVER_S, "keepalive_timeout_s": 1.0}
BODY = b'{"model": "tiny", "prompt": "the capital of", "max_tokens": 2}'


def on_uvloop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on uvloop, the gateway's loop: its transports are not asyncio's."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        uvloop.run(test(*args, **kwargs))

    return run


@contextlib.asynccontextmanager
async def listening(
    tok: Any, body_read_timeout_s: float = NEVER_S, **limits: Any
) -> AsyncIterator[tuple[int, ConnectionGuard]]:
    """The gateway app on a fake backend, listening on a free port: (port, its guard)."""
    app = create_app(FakeBackend(tok), tok, body_read_timeout_s=body_read_timeout_s)
    connection_limits = ConnectionLimits(**limits)
    runner = make_runner(app, connection_limits)
    await runner.setup()
    try:
        guard = await listen(
            runner,
            "127.0.0.1",
            0,
            reuse_port=False,
            limits=connection_limits,
            on_refused=app[STATE].metrics.connections_refused.inc,
        )
        yield runner.addresses[0][1], guard
    finally:
        await runner.cleanup()


def _head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _answer(reader: asyncio.StreamReader, within_s: float) -> tuple[int | None, bytes]:
    """Everything until the server closes: (status or None when it answered nothing, body)."""
    data = await asyncio.wait_for(reader.read(), within_s)
    head, _, body = data.partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].split()
    return (int(first[1]) if len(first) > 1 else None), body


async def _closed_without_answer(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except ConnectionError:  # a byte we sent after the close met a reset
        return True


async def _complete(port: int) -> int:
    """A well-behaved completion on its own connection: its status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = _head(
            "POST",
            "/v1/completions",
            "Content-Type: application/json",
            f"Content-Length: {len(BODY)}",
            "Connection: close",
        )
        writer.write(head + BODY)
        status, body = await _answer(reader, MARGIN_S)
        assert json.loads(body)["choices"], body
        return status or 0
    finally:
        writer.close()


async def _trickle(writer: asyncio.StreamWriter, pieces: Any, every_s: float = 0.1) -> None:
    with contextlib.suppress(ConnectionError):
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(every_s)


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response of a keep-alive connection, by its Content-Length: (status, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    return int(head.split()[1]), await reader.readexactly(length)


async def _get(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """GET path on a new keep-alive connection, left open: (reader, writer, status)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head("GET", path))
    status, _ = await asyncio.wait_for(_response(reader), MARGIN_S)
    return reader, writer, status


async def _body_attack(port: int, first: bytes, pieces: Any, limit_s: float) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    feeder = asyncio.ensure_future(_trickle(writer, pieces))
    try:
        assert await _complete(port) == 200  # served while the body is stuck
        # Read by Content-Length: aiohttp then lingers a while for the rest of the body.
        status, body = await asyncio.wait_for(_response(reader), limit_s + MARGIN_S)
    finally:
        feeder.cancel()
        writer.close()
    return status, json.loads(body)


@on_uvloop
async def test_a_body_shorter_than_its_content_length_is_answered_408(tokenizer):
    async with listening(tokenizer, body_read_timeout_s=1.0) as (port, _):
        head = _head("POST", "/v1/completions", "Content-Type: application/json",
                     f"Content-Length: {10 * len(BODY)}")  # fmt: skip
        status, body = await _body_attack(port, head + BODY, [], limit_s=1.0)
        assert status == 408
        assert body["error"]["code"] == "request_timeout"
        assert body["error"]["type"] == "timeout_error"


@on_uvloop
async def test_a_chunked_body_that_never_ends_is_answered_408(tokenizer):
    async with listening(tokenizer, body_read_timeout_s=1.0) as (port, _):
        head = _head("POST", "/v1/completions", "Content-Type: application/json",
                     "Transfer-Encoding: chunked")  # fmt: skip
        first = head + b"%x\r\n%s\r\n" % (len(BODY), BODY)
        endless = iter(lambda: b"1\r\n \r\n", None)  # one space per chunk, forever
        status, body = await _body_attack(port, first, endless, limit_s=1.0)
        assert status == 408
        assert body["error"]["code"] == "request_timeout"


async def _slow_body_completion(port: int, every_s: float) -> tuple[int, bytes]:
    """A completion whose head comes at once and whose body a byte every every_s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = _head("POST", "/v1/completions", "Content-Type: application/json",
                 f"Content-Length: {len(BODY)}", "Connection: close")  # fmt: skip
    await _trickle(writer, [head, *(bytes([b]) for b in BODY)], every_s)
    try:
        return await asyncio.wait_for(_response(reader), MARGIN_S)
    finally:
        writer.close()


@on_uvloop
async def test_a_head_sent_a_byte_at_a_time_is_closed(tokenizer):
    async with listening(tokenizer, **HEAD_TIMER_ONLY) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        padding = b"X-Pad: a\r\n" * 1000  # the blank line that ends a head never comes
        feeder = asyncio.ensure_future(
            _trickle(writer, (bytes([b]) for b in _head("GET", "/health")[:-2] + padding))
        )
        try:
            # Served meanwhile, though its body takes longer than the head timeout: once a head is
            # complete, what follows is a body, which the head timer leaves alone.
            status, body = await _slow_body_completion(port, every_s=0.025)
            assert status == 200, body
            assert await _closed_without_answer(reader, 1.0 + MARGIN_S)
        finally:
            feeder.cancel()
            writer.close()


@on_uvloop
async def test_an_idle_keep_alive_connection_is_closed(tokenizer):
    async with listening(tokenizer, **KEEPALIVE_ONLY) as (port, _):
        reader, writer, status = await _get(port, "/health")
        try:
            assert status == 200
            assert await _complete(port) == 200
            assert await _closed_without_answer(reader, 1.0 + MARGIN_S)
        finally:
            writer.close()


@on_uvloop
async def test_connections_past_the_cap_are_refused_until_some_close(tokenizer):
    async with listening(tokenizer, max_connections=4) as (port, guard):
        held = [await _get(port, "/health") for _ in range(4)]
        assert [status for _, _, status in held] == [200] * 4  # all four open, and served

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        status, body = await _answer(reader, MARGIN_S)  # refused at once, before any request
        writer.close()
        assert status == 503
        assert json.loads(body)["error"]["code"] == "too_many_connections"

        for _, held_writer, _ in held:
            held_writer.close()
        await eventually(lambda: not guard.connections)
        reader, writer, status = await _get(port, "/health")
        assert status == 200
        writer.write(_head("GET", "/metrics"))
        status, body = await asyncio.wait_for(_response(reader), MARGIN_S)
        writer.close()
        assert b"pagedserve_connections_refused_total 1.0" in body


@on_uvloop
@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",  # a control byte
        b"P@ST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",  # not a method
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a line past aiohttp's limit
    ],
)
async def test_a_head_aiohttp_cannot_parse_gets_an_openai_error_body(tokenizer, head):
    async with listening(tokenizer) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        status, body = await _answer(reader, MARGIN_S)
        writer.close()
    assert status is not None and 400 <= status < 500
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed")
    assert set(error) == {"message", "type", "param", "code"}
