"""Reading a request body under a deadline, so a client that stops sending cannot hold a handler."""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.gateway.http_errors import RequestTimeoutError

DEFAULT_BODY_READ_TIMEOUT_S = 30.0
BODY_READ_TIMEOUT = web.AppKey("pagedserve_body_read_timeout_s", float)


async def read_body(request: web.Request) -> bytes:
    """The whole body, which must arrive within the app's body read timeout, else a 408.

    aiohttp times nothing once a head is complete: a Content-Length larger than what is sent,
    or a chunked body that never ends, would hold the handler (and its connection) forever.
    """
    timeout_s = request.app.get(BODY_READ_TIMEOUT, DEFAULT_BODY_READ_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within the server's {timeout_s:g} s body read "
            "timeout",
            code="request_timeout",
        ) from None
