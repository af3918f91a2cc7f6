"""The hostile-input harness's own parts: OpenAI error shapes, the soak's sorting of hostile
answers, and the slow-client sockets against servers that close, answer, or never do."""

from __future__ import annotations

import asyncio

from tests.service.hostile_payloads import deep_json, openai_error
from tests.service.hostile_traffic import HostileTally
from tests.service.raw_http import hold_open, status_of

OPENAI = (
    '{"error": {"message": "no", "type": "invalid_request_error", "param": null, "code": null}}'
)


def test_openai_error_shape():
    assert openai_error(OPENAI)
    assert not openai_error('{"error": "no"}')
    assert not openai_error('{"error": {"message": "no"}}')
    assert not openai_error("500 Internal Server Error")


def test_deep_json_nests_as_asked():
    calls = deep_json("m", 5)
    assert [path for path, _ in calls] == ["/v1/completions", "/v1/completions", "/v1/tokenize"]
    assert calls[0][1] == b"[[[[[]]]]]"
    assert b'"prompt": [[[[[]]]]]' in calls[1][1]


def test_tally_sorts_answers():
    tally = HostileTally()
    tally.add("deep_json", "refused", {"status": 400, "openai_error": True})
    tally.add("deep_json", "refused", {"status": 200})
    tally.add("medium_enum", "answered", {"status": 200})
    tally.add("medium_enum", "answered", {"status": 400, "openai_error": True})
    tally.add("long_prompt", "answered", {"status": 500, "openai_error": False, "detail": "boom"})
    tally.add("lone_surrogate", "refused", {"status": 400, "openai_error": False})
    tally.add("slow_socket", "answered", {"attack": "slow_head", "status": None,
                                          "held_until_cap": False})  # fmt: skip
    tally.add("slow_socket", "answered", {"attack": "slow_head", "status": None,
                                          "held_until_cap": True})  # fmt: skip
    figures = tally.figures()
    assert (figures["expected_4xx"], figures["other_4xx"], figures["served"]) == (1, 1, 1)
    assert figures["server_errors_5xx"] == 1
    assert [u.split(":")[:2] for u in tally.unexpected] == [
        ["deep_json", " accepted"],
        ["long_prompt", " 5xx"],
        ["lone_surrogate", " error body not OpenAI's"],
    ]
    assert figures["slow_sockets"] == {"closed_by_server": 1, "left_by_client": 1}
    assert figures["by_kind"]["slow_socket"] == {"closed": 1, "open": 1}


async def _server(on_connect) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_hold_open_sees_an_answer():
    async def answer_408(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server, port = await _server(answer_408)
    async with server:
        result = await hold_open("127.0.0.1", port, "content_length_short", cap_s=30)
    assert (result["status"], result["held_until_cap"]) == (408, False)
    assert result["answer"] == "HTTP/1.1 408 Request Timeout"


async def test_hold_open_sees_a_close_while_trickling():
    async def close_after_a_few_bytes(reader, writer):
        await reader.readexactly(3)
        writer.close()

    server, port = await _server(close_after_a_few_bytes)
    async with server:
        result = await hold_open("127.0.0.1", port, "slow_head", cap_s=30, step_s=0.01)
    assert (result["status"], result["held_until_cap"]) == (None, False)


async def test_hold_open_gives_up_at_its_cap():
    async def never_answer(reader, writer):
        await reader.read()  # until the client leaves

    server, port = await _server(never_answer)
    async with server:
        result = await hold_open("127.0.0.1", port, "chunked_endless", cap_s=0.3, step_s=0.05)
    assert result["held_until_cap"] and result["closed_after_s"] is None


def test_status_of():
    assert status_of(b"HTTP/1.1 400 Bad Request\r\n\r\n") == 400
    assert status_of(b"") is None
    assert status_of(b"garbage") is None
