"""Faults against a real `pagedserve serve` on a tiny model: a killed executor, gateway or
scheduler is replaced by the launcher; no request is lost to a dead executor, none hangs."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from tests.service.stack_process import (
    HEADERS,
    ServeProcess,
    metric,
    stream,
    wait_health,
    wait_metric,
)

PROMPTS = [[5 + i, 17, 40 + 3 * i, 9, 33 + i] * (1 + i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def serve(tiny_model_dir):
    stack = ServeProcess(
        tiny_model_dir, "--num-device-blocks", "256", "--max-num-seqs", "16",
        "--max-restarts", "5", "--restart-window", "600",
    )  # fmt: skip
    yield stack
    assert stack.stop() == 0  # SIGTERM still stops all three in order, after restarts too


def test_the_services_share_the_launchers_session_each_in_a_group_of_its_own(serve):
    # A session each would make each a scheduling group of its own under Linux's autogroups,
    # where the gateway's SCHED_IDLE body parser took its group's half of the cores from the
    # executor's steps (docs/reliability.md, "sixth round"). A process group each: Ctrl-C on
    # the launcher's terminal reaches only the launcher, which stops them in order.
    launcher = serve.proc.pid
    for name, pid in serve.pids.items():
        assert os.getsid(pid) == os.getsid(launcher), name
        assert os.getpgid(pid) == pid, name


def _bodies(model: str) -> list[dict]:
    greedy = [
        {"model": model, "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        for p in PROMPTS
    ]
    seeded = {
        "model": model, "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 1.0, "seed": 42,
        "n": 2, "ignore_eos": True,
    }  # fmt: skip
    return [*greedy, seeded]


async def _run_all(serve: ServeProcess, on_progress=None) -> list[dict]:
    url = f"{serve.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(
            *(stream(session, url, body, on_progress) for body in _bodies(serve.model))
        )


async def test_a_killed_executor_is_replaced_and_no_request_is_lost(serve):
    expected = await _run_all(serve)
    assert all(r["done"] and r["error"] is None for r in expected)

    events = {"count": 0}
    killed = {}

    def on_event() -> None:
        events["count"] += 1
        if events["count"] == 5 * len(PROMPTS) and not killed:
            killed["pid"] = serve.kill("executor")
            killed["t"] = time.monotonic()

    got = await _run_all(serve, on_event)
    assert killed, "the requests ended before the executor could be killed"
    serve.wait_restarted(1)
    assert serve.restarts == ["executor"]
    for before, after in zip(expected, got):
        assert after["status"] == 200 and after["error"] is None and after["done"]
        assert after["texts"] == before["texts"]  # greedy and seeded (n=2) alike
        assert set(after["finish"].values()) == {"length"}
    pause = max(b - a for r in got for a, b in zip(r["times"], r["times"][1:]))
    print(f"longest pause between two events of one stream: {pause:.2f} s")
    async with aiohttp.ClientSession() as session:
        assert await metric(session, serve.url, "pagedserve_executor_restarts_total") == 1
        await wait_metric(session, serve.url, "pagedserve_kv_blocks_used", 0)
        await wait_health(session, serve.url)


async def _long_streams_under_way(session, url: str, body: dict) -> list[asyncio.Future]:
    """One stream per prompt, returned once 8 events have arrived (they are all decoding)."""
    started = asyncio.Event()
    counts = {"n": 0}

    def on_event() -> None:
        counts["n"] += 1
        if counts["n"] >= 8:
            started.set()

    streams = [
        asyncio.ensure_future(stream(session, url, body | {"prompt": p}, on_event)) for p in PROMPTS
    ]
    await asyncio.wait_for(started.wait(), 60)
    return streams


async def test_a_killed_gateway_is_replaced_and_its_requests_are_aborted(serve):
    url = f"{serve.url}/v1/completions"
    body = {"model": serve.model, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        streams = await _long_streams_under_way(session, url, body)
        assert await metric(session, serve.url, "pagedserve_kv_blocks_used") > 0
        restarts = len(serve.restarts)
        serve.kill("gateway")
        results = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(r, aiohttp.ClientError) or not r["done"] for r in results)
        serve.wait_restarted(restarts + 1)
        assert serve.restarts[-1] == "gateway"
        await wait_health(session, serve.url)
        # No ghost decoding: the dead gateway's requests were aborted and freed their blocks.
        await wait_metric(session, serve.url, "pagedserve_kv_blocks_used", 0)
        await wait_metric(session, serve.url, "pagedserve_num_requests_running", 0)
        ok = await stream(session, url, body | {"prompt": PROMPTS[0], "max_tokens": 5})
        assert ok["done"] and ok["error"] is None


async def test_a_killed_scheduler_ends_streams_with_an_error_then_service_resumes(serve):
    url = f"{serve.url}/v1/completions"
    body = {"model": serve.model, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        streams = await _long_streams_under_way(session, url, body)
        restarts = len(serve.restarts)
        serve.kill("scheduler")
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)  # none hangs
        ended_s = time.monotonic() - t0
        print(f"all streams ended {ended_s:.2f} s after the scheduler was killed")
        for r in results:
            # A stream under way ends with an error event and [DONE]; one whose response had
            # not started yet (still queued) is answered 503 with the same OpenAI error.
            assert r["status"] in (200, 503), r
            assert r["done"] or r["status"] == 503, r
            assert r["error"]["type"] == "service_unavailable_error", r
        assert any(r["status"] == 200 and r["done"] for r in results)  # some were under way
        async with session.post(url, json=body | {"prompt": PROMPTS[0]}, headers=HEADERS) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"  # until a new one is up
        serve.wait_restarted(restarts + 1)
        assert serve.restarts[-1] == "scheduler"
        await wait_health(session, serve.url)
        ok = await stream(session, url, body | {"prompt": PROMPTS[0], "max_tokens": 5})
        assert ok["done"] and ok["error"] is None


def test_past_the_restart_budget_requests_end_with_a_clear_error(tiny_model_dir):
    stack = ServeProcess(
        tiny_model_dir, "--num-device-blocks", "128", "--max-restarts", "0",
    )  # fmt: skip
    url = f"{stack.url}/v1/completions"
    body = {"model": stack.model, "max_tokens": 400, "ignore_eos": True, "prompt": PROMPTS[1]}
    counts = {"n": 0}

    def on_event() -> None:
        counts["n"] += 1
        if counts["n"] == 3:
            stack.kill("executor")

    async def run() -> dict:
        async with aiohttp.ClientSession() as session:
            return await stream(session, url, body, on_event)

    result = asyncio.run(run())
    assert result["done"] and "gives up" in result["error"]["message"]
    assert stack.proc.wait(60) == 1
