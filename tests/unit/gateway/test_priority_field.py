"""The priority request field: accepted by both generation endpoints, refused when malformed."""

from __future__ import annotations

import pytest

from services.gateway.openapi import openapi_spec
from tests.support.gateway_fakes import chat, completion


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", completion), ("/v1/chat/completions", chat)],
    ids=["completions", "chat"],
)
async def test_priority_reaches_the_scheduler_and_defaults_to_zero(serve, path, body) -> None:
    client, backend = await serve()
    for sent, expected in [({"priority": -3}, -3), ({}, 0), ({"priority": None}, 0)]:
        resp = await client.post(path, json=body(**sent))
        assert resp.status == 200, await resp.text()
        assert backend.requests[-1].sampling.priority == expected


@pytest.mark.parametrize("value", ["1", 1.5, True, 2**31, -(2**31) - 1, [1]])
async def test_a_malformed_priority_is_a_400_naming_it(serve, value) -> None:
    client, backend = await serve()
    for path, body in [("/v1/completions", completion), ("/v1/chat/completions", chat)]:
        resp = await client.post(path, json=body(priority=value))
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "priority")
    assert backend.requests == []


def test_the_openapi_schema_describes_priority_on_both_endpoints():
    spec = openapi_spec("tiny")
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        prop = body["schema"]["properties"]["priority"]
        assert (prop["type"], prop["minimum"], prop["maximum"]) == ("integer", -(2**31), 2**31 - 1)
