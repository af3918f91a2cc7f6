"""The gateway's aiohttp application: routes, API-key check, OpenAI-style errors, /metrics."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.gateway.auth import BROWSER_PATHS, authorized, browser_challenge
from services.gateway.backend import Backend
from services.gateway.dashboard import add_dashboard_routes
from services.gateway.detokenizer import TokenTexts
from services.gateway.http_errors import AuthenticationError, ServiceUnavailableError
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import openapi_spec
from services.gateway.prompts import DEFAULT_MAX_CHAT_MESSAGES
from services.gateway.request_body import BODY_READ_TIMEOUT, DEFAULT_BODY_READ_TIMEOUT_S
from services.gateway.responses_api import handle_responses
from services.gateway.serving import INTERNAL_ERROR, handle_generate
from services.gateway.state import GatewayState
from services.gateway.tokenize import handle_detokenize, handle_tokenize
from services.gateway.tokenizer_info import handle_tokenizer_info
from shared.errors import ModelNotFoundError, PagedServeError

log = logging.getLogger(__name__)

STATE = web.AppKey("pagedserve_gateway", GatewayState)
MAX_BODY_BYTES = 32 * 1024 * 1024  # long prompts sent as token-id lists exceed aiohttp's 1 MiB
_OPEN_PATHS = frozenset({"/health"})  # probes carry no key; scrapers send it as a bearer token

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    backend: Backend,
    tokenizer: Any,
    *,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
    request_timeout_s: float | None = None,
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
) -> web.Application:
    state = GatewayState(
        backend=backend,
        tokenizer=tokenizer,
        metrics=GatewayMetrics(lambda: backend.stats, getattr(backend, "replica_table", None)),
        texts=TokenTexts(tokenizer),
        api_key=api_key,
        max_queued_requests=max_queued_requests,
        max_chat_messages=max_chat_messages,
        request_timeout_s=request_timeout_s,
    )
    if hasattr(backend, "on_route"):  # several replicas: count each routing on /metrics
        backend.on_route = lambda i: state.metrics.replica_requests.labels(str(i)).inc()
    app = web.Application(middlewares=[_errors, _auth], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app[BODY_READ_TIMEOUT] = body_read_timeout_s
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    for prefix in ("", "/v1"):  # vLLM serves these without the prefix; OpenAI clients add it
        app.router.add_post(f"{prefix}/tokenize", _tokenize)
        app.router.add_post(f"{prefix}/detokenize", _detokenize)
    app.router.add_get("/tokenizer_info", _tokenizer_info)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    add_dashboard_routes(app, STATE)  # /dashboard and /v1/kv_state: the live block map
    app.on_cleanup.append(_drain)
    return app


async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle_generate(request, request.app[STATE], "completion")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generate(request, request.app[STATE], "chat")


async def _responses(request: web.Request) -> web.StreamResponse:
    return await handle_responses(request, request.app[STATE])


async def _tokenize(request: web.Request) -> web.Response:
    return await handle_tokenize(request, request.app[STATE])


async def _detokenize(request: web.Request) -> web.Response:
    return await handle_detokenize(request, request.app[STATE])


async def _tokenizer_info(request: web.Request) -> web.Response:
    return await handle_tokenizer_info(request, request.app[STATE])


async def _openapi(request: web.Request) -> web.Response:
    info = request.app[STATE].backend.info
    return web.json_response(openapi_spec(info.model_name if info is not None else None))


def _model_cards(state: GatewayState) -> list[dict[str, Any]]:
    """One card per name the model is served under (its aliases are the same model)."""
    info = state.require_info()
    return [
        {
            "id": name,
            "object": "model",
            "created": state.started,
            "owned_by": "pagedserve",
            "max_model_len": info.executor.max_model_len,
        }
        for name in (info.model_name, *info.model_aliases)
    ]


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_cards(request.app[STATE])})


async def _model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for card in _model_cards(request.app[STATE]):
        if card["id"] == name:
            return web.json_response(card)
    raise ModelNotFoundError(
        f"the model `{name}` does not exist", param="model", code="model_not_found"
    )


async def _health(request: web.Request) -> web.Response:
    backend = request.app[STATE].backend
    # Degraded: still serving, and saying so: some replica is down, or a dead executor is being
    # replaced (its requests wait for the new one).
    degraded = getattr(backend, "degraded", False)
    if not (backend.ready or degraded):
        error = ServiceUnavailableError("the model server is not ready", code="not_ready")
        return web.json_response(error.to_dict(), status=error.http_status)
    return web.json_response({"status": "degraded" if degraded else "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _drain(app: web.Application) -> None:
    await app[STATE].drain()


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key is not None and request.path not in _OPEN_PATHS and not authorized(request, key):
        if request.path in BROWSER_PATHS:
            return browser_challenge()
        raise AuthenticationError("missing or invalid API key", code="invalid_api_key")
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except PagedServeError as exc:
        # Clients that back off (OpenAI's included) read Retry-After on 429 and 503.
        headers = {"Retry-After": "1"} if exc.http_status in (429, 503) else None
        return web.json_response(exc.to_dict(), status=exc.http_status, headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = "invalid_request_error" if exc.status < 500 else "internal_error"
        body = {"message": exc.reason, "type": error_type, "param": None, "code": None}
        return web.json_response({"error": body}, status=exc.status)
    except ConnectionError:
        # The client is gone; there is nobody to tell, and this is not a server fault.
        return web.Response(status=499, reason="Client Closed Request")
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(INTERNAL_ERROR, status=500)
