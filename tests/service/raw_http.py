"""HTTP over raw sockets, for what an HTTP client refuses to send: bad header bytes, bodies shorter
than their Content-Length, chunked bodies that never end, headers trickled a byte at a time."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator

from tests.service.stack_process import API_KEY

COMPLETIONS = "/v1/completions"
ATTACKS = ("content_length_short", "chunked_endless", "slow_head")


def request_head(path: str, extra: str = "", auth: bytes | None = None) -> bytes:
    auth = auth if auth is not None else f"Bearer {API_KEY}".encode()
    head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}"
    return head.encode() + b"Authorization: " + auth + b"\r\n"


def status_of(answer: bytes) -> int | None:
    """The status code of a response's first line, or None when there is none."""
    parts = answer.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") else None


async def exchange(host: str, port: int, data: bytes, timeout_s: float) -> tuple[int | None, str]:
    """Send one whole request and read the answer until the server closes: (status, body)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    body = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
    return status_of(answer), body.decode(errors="replace")


def _attack(kind: str, path: str) -> tuple[bytes, Iterator[bytes]]:
    """What to send at once, and what to trickle after it (one piece per step)."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    if kind == "content_length_short":
        head = request_head(path, f"Content-Length: {100 * len(body)}\r\n") + b"\r\n"
        return head + body, iter(())
    if kind == "chunked_endless":
        head = request_head(path, "Transfer-Encoding: chunked\r\n") + b"\r\n"
        # Each piece is a one-byte chunk holding a space, so the body stays valid JSON so far.
        return head + b"%x\r\n%s\r\n" % (len(body), body), itertools.repeat(b"1\r\n \r\n")
    if kind == "slow_head":
        head = request_head(path)
        padding = itertools.cycle(b"X-Pad: a\r\n")  # the blank line that ends a head never comes
        return b"", (bytes([b]) for b in itertools.chain(head, padding))
    raise ValueError(kind)


async def hold_open(
    host: str, port: int, kind: str, cap_s: float, step_s: float = 1.0, path: str = COMPLETIONS
) -> dict:
    """Run one slow-client attack until the server answers or closes, or `cap_s` passes."""
    t0 = time.monotonic()
    first, trickle = _attack(kind, path)
    reader, writer = await asyncio.open_connection(host, port)

    async def feed() -> None:
        writer.write(first)
        await writer.drain()
        for piece in trickle:
            await asyncio.sleep(step_s)
            writer.write(piece)
            await writer.drain()
        await asyncio.sleep(cap_s)  # all sent: only wait

    answer = asyncio.ensure_future(reader.read(256))
    feeding = asyncio.ensure_future(feed())
    done, _ = await asyncio.wait({answer, feeding}, timeout=cap_s, return_when="FIRST_COMPLETED")
    elapsed = time.monotonic() - t0
    data = answer.result() if answer in done and answer.exception() is None else b""
    for task in (answer, feeding):
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, OSError):
        await asyncio.gather(answer, feeding, return_exceptions=True)
    writer.close()
    return {
        "attack": kind,
        "wall_s": round(elapsed, 1),
        "closed_after_s": None if not done else round(elapsed, 1),
        "status": status_of(data),
        "answer": data.split(b"\r\n", 1)[0].decode(errors="replace") or None,
        "held_until_cap": not done,
    }
