"""GET /dashboard (a static page, no build step) and GET /v1/kv_state (the JSON it polls)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from services.gateway.http_errors import ServiceUnavailableError
from services.gateway.kv_state import kv_state_json

PAGE = Path(__file__).with_name("static") / "dashboard.html"


def add_dashboard_routes(app: web.Application, state_key: web.AppKey) -> None:
    async def dashboard(request: web.Request) -> web.Response:
        return web.FileResponse(PAGE, headers={"Cache-Control": "no-store"})

    async def kv_state(request: web.Request) -> web.Response:
        backend = request.app[state_key].backend
        fetch = getattr(backend, "kv_state", None)  # backends without a scheduler have no map
        if fetch is None or not backend.ready:
            raise ServiceUnavailableError("the block map is not available", code="not_ready")
        state = await fetch()
        return web.json_response(kv_state_json(state), headers={"Cache-Control": "no-store"})

    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/v1/kv_state", kv_state)
