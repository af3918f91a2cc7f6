"""Fixtures for the gateway's HTTP app over FakeBackend (registered in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import create_app
from tests.factories import make_tiny_tokenizer
from tests.support.gateway_fakes import FakeBackend


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tiny_tokenizer(384)


@pytest.fixture
async def serve(tokenizer: Any) -> AsyncIterator[Callable[..., Any]]:
    """serve(**create_app kwargs) -> (TestClient, FakeBackend)."""
    clients: list[TestClient] = []

    async def make(**kwargs: Any) -> tuple[TestClient, FakeBackend]:
        backend = FakeBackend(tokenizer)
        client = TestClient(TestServer(create_app(backend, tokenizer, **kwargs)))
        await client.start_server()
        clients.append(client)
        return client, backend

    yield make
    for client in clients:
        await client.close()
