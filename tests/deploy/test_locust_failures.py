"""The Locust users fail a request on a broken stream: no [DONE], an error event, bad JSON."""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None, reason="locust is not installed"
)

CHUNK = {"choices": [{"index": 0, "text": "x", "delta": {"content": "x"}}]}
BROKEN = {
    "no_done": [json.dumps(CHUNK)],
    "error_event": [json.dumps(CHUNK), json.dumps({"error": {"message": "boom"}}), "[DONE]"],
    "bad_json": [json.dumps(CHUNK), "{not json", "[DONE]"],
}


def _broken_server() -> web.Application:
    kinds = itertools.cycle(BROKEN)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in BROKEN[next(kinds)]:
            await response.write(f"data: {data}\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    return app


async def test_broken_streams_are_failures(tmp_path):
    runner = web.AppRunner(_broken_server())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
            "--headless", "--only-summary", "-u", "2", "-r", "2", "-t", "4s",
            "--host", f"http://127.0.0.1:{port}", "--csv", str(tmp_path / "locust"),
            env={**os.environ, "LOADTEST_SEED": "0"},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert await asyncio.wait_for(proc.wait(), 120) == 1  # Locust's exit code on failures
    finally:
        await runner.cleanup()
    with open(tmp_path / "locust_failures.csv") as f:
        messages = " ".join(row["Error"] for row in csv.DictReader(f))
    assert "without data: [DONE]" in messages
    assert "error event: boom" in messages
    assert "malformed JSON event" in messages
    with open(tmp_path / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert rows[("", "Aggregated")]["Failure Count"] != "0"
    assert ("TTFT", "chat") not in rows  # a failed stream reports no token timings
