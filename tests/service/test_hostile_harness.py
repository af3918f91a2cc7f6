"""The hostile-input harness's own parts: OpenAI error shapes, the soak's sorting of hostile
answers, the slow-client sockets against servers that close, answer, or never do, and the
bodies sent from processes of their own or from the probe's loop."""

from __future__ import annotations

import asyncio
import os
from functools import partial

import pytest
from aiohttp import web

from tests.service.hostile_client import matched_ratios, probe_figures
from tests.service.hostile_payloads import (
    deep_json,
    lone_surrogate,
    many_messages,
    openai_error,
    prebuilt,
)
from tests.service.hostile_sender import ProcessSenders
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


async def _body_server() -> tuple[web.AppRunner, str, list[bytes]]:
    """A server that keeps each body it is posted and answers 200, or 400 to a tokenize."""
    received: list[bytes] = []

    async def keep(request: web.Request) -> web.Response:
        received.append(await request.read())
        if request.path == "/v1/tokenize":
            return web.Response(status=400, text=OPENAI, content_type="application/json")
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/{tail:.*}", keep)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", received


async def test_process_senders_build_and_post_each_body():
    recipes = [partial(many_messages, "m", 1000), *prebuilt(lone_surrogate("m"))[1:2]]
    runner, url, received = await _body_server()
    senders = ProcessSenders(url, recipes)
    try:
        await senders.start()
        assert received == []  # built, not sent before the go
        answers = await asyncio.gather(*(call() for call in senders.calls()))
    finally:
        senders.close()
        await runner.cleanup()
    assert [(a["path"], a["status"]) for a in answers] == [
        ("/v1/chat/completions", 200),
        ("/v1/tokenize", 400),
    ]
    assert answers[1]["openai_error"] and answers[0]["wall_s"] >= 0
    assert sorted(received) == sorted(recipe()[1] for recipe in recipes)


async def test_idle_process_senders_post_under_sched_idle_in_a_session_of_their_own():
    runner, url, received = await _body_server()
    senders = ProcessSenders(url, [partial(many_messages, "m", 10)], idle=True)
    try:
        await senders.start()
        # Set before "ready": at the go the process only sends, and only on idle CPU time.
        assert [os.sched_getscheduler(pid) for pid in senders.pids] == [os.SCHED_IDLE]
        # SCHED_IDLE ranks a process only within its session's scheduling group (autogroups).
        assert [os.getsid(pid) for pid in senders.pids] == senders.pids
        (answer,) = await asyncio.gather(*(call() for call in senders.calls()))
    finally:
        senders.close()
        await runner.cleanup()
    assert (answer["path"], answer["status"]) == ("/v1/chat/completions", 200)
    assert len(received) == 1


async def test_process_senders_report_a_body_that_could_not_be_built():
    senders = ProcessSenders("http://127.0.0.1:9", [partial(many_messages, "m", "not a count")])
    try:
        with pytest.raises(RuntimeError, match="did not build its body"):
            await senders.start()
    finally:
        senders.close()


def test_a_row_named_with_a_sender():
    from scripts.hostile_inputs import ROWS, row_named

    row = row_named("messages_100k_x8@loop")
    assert (row.name, row.sender, row.what) == (
        "messages_100k_x8@loop",
        "loop",
        ROWS["messages_100k_x8"].what,
    )
    assert ROWS["messages_100k_x8"].sender == "process"
    assert row_named("messages_100k_x8@idle-process").sender == "idle-process"
    assert row_named("enum_50k") is ROWS["enum_50k"]
    for bad in ("enum_50k@thread", "slow_head@process", "nope"):
        with pytest.raises(ValueError):
            row_named(bad)


def test_a_repeated_recipe_is_built_once_on_the_loop():
    from scripts.hostile_inputs import sent_from_loop

    built = []

    def recipe():
        built.append(1)
        return ("/v1/completions", b"{}")

    calls = sent_from_loop(None, [recipe] * 3 + [lambda: ("/v1/tokenize", b"{}")])
    assert (len(calls), len(built)) == (4, 1)
    assert [call.args[1][0] for call in calls] == ["/v1/completions"] * 3 + ["/v1/tokenize"]


def test_probe_figures_say_when_the_longest_waits_began():
    probes = [
        {"status": 200, "unfinished": False, "started": 10.5, "gaps": [0.2, 0.1, 0.3]},
        {"status": 200, "unfinished": False, "started": 11.2, "gaps": [0.5, 0.1, 0.1]},
    ]
    figures = probe_figures(probes, t0=10.0)
    assert (figures["longest_first_token_s"], figures["longest_gap_s"]) == (0.5, 0.3)
    # The first probe's third gap began 0.5 + 0.2 + 0.1 s after t0; the second probe at 1.2 s.
    assert figures["longest_gap_at_s"] == 0.8
    assert figures["longest_first_token_at_s"] == 1.2
    assert "longest_gap_at_s" not in probe_figures(probes)


def test_a_row_is_held_against_as_many_idle_gaps_as_it_had():
    probes = [
        {"status": 200, "unfinished": False, "started": 0.0, "gaps": [0.05, 0.04, g, 0.04]}
        for g in (0.04, 0.04, 0.12)
    ]
    row = probe_figures(probes)
    idle = probe_figures(probes[:2] + [{**probes[0], "gaps": [0.05, 0.04, 0.06, 0.04]}])
    ratios = matched_ratios(row, idle)
    assert ratios["longest_gap_x_matched_idle"] == 2.0  # 0.12 over the idle probes' 0.06
    assert ratios["longest_first_token_x_matched_idle"] == 1.0
    assert row["p99_gap_s"] > idle["p99_gap_s"]
