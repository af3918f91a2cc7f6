"""GET /dashboard and GET /v1/kv_state: behind the API key (Bearer or Basic), JSON, caching."""

from __future__ import annotations

import asyncio
import base64

import pytest

from services.gateway import kv_state as gateway_kv_state
from services.gateway.http_errors import ServiceUnavailableError
from services.gateway.kv_state import KvStateCache
from services.scheduler.kv_state import PreemptionLog, kv_snapshot
from tests.support.scheduler_steps import contended

KEY = "dash-key"


def _basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"anyone:{password}".encode()).decode()}


async def test_the_page_and_the_map_need_the_key(serve):
    client, backend = await serve(api_key=KEY)
    backend.kv_state = lambda: _async(kv_snapshot(contended("swap"), PreemptionLog()))

    page = await client.get("/dashboard")
    assert page.status == 401
    assert page.headers["WWW-Authenticate"].startswith("Basic ")  # the browser asks for it
    data = await client.get("/v1/kv_state")
    assert data.status == 401 and "WWW-Authenticate" not in data.headers
    assert (await data.json())["error"]["code"] == "invalid_api_key"
    assert (await client.get("/dashboard", headers=_basic("wrong"))).status == 401

    for headers in ({"Authorization": f"Bearer {KEY}"}, _basic(KEY)):
        page = await client.get("/dashboard", headers=headers)
        assert page.status == 200
        assert page.headers["Content-Type"].startswith("text/html")
        assert "/v1/kv_state" in await page.text()
        data = await client.get("/v1/kv_state", headers=headers)
        assert data.status == 200
        body = await data.json()
        assert body["device_owners"] == [0, 1, 0, 1]
        assert body["summary"]["device_used"] == 4 and body["summary"]["num_waiting"] == 1


async def test_a_backend_without_a_block_map_answers_503(serve):
    client, _ = await serve()
    response = await client.get("/v1/kv_state")
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "not_ready"


async def _async(value):
    return value


async def test_concurrent_pollers_share_one_request_and_a_fresh_map():
    sent = []
    cache: KvStateCache

    async def send_request() -> None:
        sent.append(1)
        asyncio.get_running_loop().call_later(0.01, cache.deliver, state)

    state = kv_snapshot(contended("swap"), PreemptionLog())
    cache = KvStateCache(send_request)
    results = await asyncio.gather(*(cache.get() for _ in range(5)))
    assert all(r is state for r in results) and len(sent) == 1
    assert await cache.get() is state and len(sent) == 1  # younger than MIN_INTERVAL_S
    await asyncio.sleep(gateway_kv_state.MIN_INTERVAL_S)
    await cache.get()
    assert len(sent) == 2


async def test_a_silent_scheduler_is_a_503(monkeypatch):
    monkeypatch.setattr(gateway_kv_state, "TIMEOUT_S", 0.05)

    async def send_request() -> None:
        pass

    with pytest.raises(ServiceUnavailableError):
        await KvStateCache(send_request).get()
