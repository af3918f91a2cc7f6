"""The API-key check: a Bearer token for API clients, or HTTP Basic (any user) for browsers."""

from __future__ import annotations

import base64
import binascii
import hmac

from aiohttp import web

# Pages a person opens in a browser, which cannot add a Bearer header: a 401 there asks the
# browser for the key (as the password), and the browser then sends it with the page's fetches.
BROWSER_PATHS = frozenset({"/dashboard"})


def authorized(request: web.Request, key: str) -> bool:
    # aiohttp decodes header bytes that are not UTF-8 to lone surrogates; surrogateescape turns
    # them back into the bytes sent, so the key is compared as the bytes the client sent.
    try:
        header = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte decodes to: not a header from the wire
        return False
    scheme, _, credentials = header.partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        token = credentials.strip()
    elif scheme == b"basic":
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True)
        except binascii.Error:
            return False
        token = decoded.partition(b":")[2]
    else:
        return False
    # The key too: argv and the environment are decoded with surrogateescape, so a key that is
    # not UTF-8 holds lone surrogates, which a strict encode would refuse on every request.
    return hmac.compare_digest(token, key.encode("utf-8", "surrogateescape"))


def browser_challenge() -> web.Response:
    body = {
        "message": "missing or invalid API key (give it as the password)",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    return web.json_response(
        {"error": body},
        status=401,
        headers={"WWW-Authenticate": 'Basic realm="pagedserve", charset="UTF-8"'},
    )
