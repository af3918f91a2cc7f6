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
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        token = credentials.strip()
    elif scheme == "basic":
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return False
        token = decoded.partition(":")[2]
    else:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


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
