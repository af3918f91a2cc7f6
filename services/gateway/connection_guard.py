"""What aiohttp does not bound per connection: how many are open, and how long a request head takes.

aiohttp's own `keepalive_timeout` closes a connection that has no complete request head that
long after it opened or after its previous response (its timer is not re-armed by arriving
bytes), so it bounds idle keep-alive connections and slow heads alike; the runner sets it. This
module adds the two limits it has no knob for, by wrapping the server's protocol factory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from services.gateway.http_errors import ServiceUnavailableError


def _refusal() -> bytes:
    error = ServiceUnavailableError(
        "too many open connections to this server; retry later", code="too_many_connections"
    )
    body = json.dumps(error.to_dict()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_REFUSAL = _refusal()


class ConnectionGuard:
    """The protocol factory for one listening socket: one `_Connection` per accepted socket."""

    def __init__(
        self,
        server: web.Server,
        *,
        max_connections: int,
        header_read_timeout_s: float,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.server = server
        self.max_connections = max_connections
        self.header_read_timeout_s = header_read_timeout_s
        self.on_refused = on_refused
        self.connections: dict[RequestHandler, _Connection] = {}  # by aiohttp's handler
        # A handler runs from a complete head to its response: while it runs, arriving bytes are
        # the body, not a new head, and must not start the head timer. RequestHandler reads this
        # attribute when it is made, so every connection sees the wrapped one.
        handle = server.request_handler

        async def handle_in_request(request: web.BaseRequest) -> web.StreamResponse:
            connection = self.connections.get(request.protocol)
            if connection is None:
                return await handle(request)
            connection.in_request(True)
            try:
                return await handle(request)
            finally:
                connection.in_request(False)

        server.request_handler = handle_in_request

    def __call__(self) -> _Connection:
        return _Connection(self)


class _Connection(asyncio.Protocol):
    """aiohttp's RequestHandler behind a cap and a head timer; every other event passes through.

    The head timer runs from the connection's start, and from the first byte that arrives while
    no request is being handled, until a handler starts (a complete head): a client that dribbles
    a head (slowloris) is closed once it runs out. A connection that sends nothing after a
    response is left to aiohttp's keep-alive timeout.
    """

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self._inner: RequestHandler | None = None  # None: refused
        self._transport: asyncio.Transport | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._handling = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        guard = self._guard
        if len(guard.connections) >= guard.max_connections:
            # Refused before aiohttp makes a handler for it: a flood of sockets costs one write
            # each, and the connections already open keep being served.
            self._transport.write(_REFUSAL)
            self._transport.close()
            guard.on_refused()
            return
        self._inner = _make_handler(guard.server)
        guard.connections[self._inner] = self
        self._start_head_timer()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._handling and self._head_timer is None:
            self._start_head_timer()  # the first byte of the next head
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._inner is None:
            return
        self._guard.connections.pop(self._inner, None)
        self._inner.connection_lost(exc)

    def in_request(self, handling: bool) -> None:
        self._handling = handling
        if handling:
            self._stop_head_timer()

    def _start_head_timer(self) -> None:
        assert self._transport is not None
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._guard.header_read_timeout_s, self._transport.close)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class _OpenAIErrorHandler(RequestHandler):
    """aiohttp's handler, except that what aiohttp answers itself (a head it cannot parse: a
    control byte in a header, a bad method, a line too long) carries OpenAI's error body, like
    every answer of the app, instead of text/plain."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; refuses once a reply began
        if status >= 500:
            error = {"message": "internal server error", "type": "internal_error"}
        else:
            detail = message or HTTPStatus(status).phrase
            error = {"message": f"malformed HTTP request: {detail}"}
            error["type"] = "invalid_request_error"
        response = web.json_response(
            {"error": error | {"param": None, "code": None}}, status=status
        )
        response.force_close()
        return response


def _make_handler(server: web.Server) -> RequestHandler:
    # What web.Server.__call__ does, with our subclass: aiohttp has no hook for the class.
    return _OpenAIErrorHandler(server, loop=server._loop, **server._kwargs)
