"""Overload against a real `pagedserve serve`: a burst of 10x the queue limit, 1,000 streams cut at
random points, and the request timeout; no hang, no 5xx, no leaked block."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import aiohttp
import pytest

from tests.service.stack_process import (
    HEADERS,
    ServeProcess,
    metric,
    stream,
    wait_metric,
)

LIMIT = 32


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def serve(tiny_model_dir):
    stack = ServeProcess(
        tiny_model_dir, "--num-device-blocks", "256", "--max-num-seqs", "32",
        "--max-queued-requests", str(LIMIT),
    )  # fmt: skip
    yield stack
    assert stack.stop() == 0


async def _post(session, url, body) -> tuple[int, float, str | None]:
    t0 = time.monotonic()
    async with session.post(url, json=body, headers=HEADERS) as response:
        await response.read()
        return response.status, time.monotonic() - t0, response.headers.get("Retry-After")


async def test_a_burst_of_ten_times_the_queue_limit(serve):
    url = f"{serve.url}/v1/completions"
    body = {"model": serve.model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True}
    rss_before = {name: rss_mib(pid) for name, pid in serve.pids.items()}
    executor = serve.pids["executor"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # A paused executor holds the step in flight, so nothing leaves the queue during the
        # burst: exactly LIMIT requests may wait (well under its 10 s heartbeat timeout).
        # Long enough that the poll below cannot miss it running.
        blocker = asyncio.ensure_future(_post(session, url, body | {"max_tokens": 300}))
        await wait_metric(session, serve.url, "pagedserve_num_requests_running", 1)
        os.kill(executor, signal.SIGSTOP)
        try:
            burst = [asyncio.ensure_future(_post(session, url, body)) for _ in range(10 * LIMIT)]
            done, _ = await asyncio.wait(burst, timeout=6)
        finally:
            os.kill(executor, signal.SIGCONT)
        results = await asyncio.gather(*burst, blocker)
    statuses = [status for status, _, _ in results[:-1]]
    refused = [r for r in results[:-1] if r[0] == 429]
    print(
        f"burst of {10 * LIMIT}: {statuses.count(200)} admitted, {len(refused)} x 429 answered "
        f"within {max(s for _, s, _ in refused):.2f} s"
    )
    assert len(done) == len(refused)  # every refusal came while the executor was paused
    assert statuses.count(200) == LIMIT and len(refused) == 9 * LIMIT
    assert results[-1][0] == 200
    assert all(retry == "1" for _, _, retry in refused)
    assert max(s for _, s, _ in refused) < 5  # fast refusals, on a busy 2-core machine too
    rss_after = {name: rss_mib(pid) for name, pid in serve.pids.items()}
    print(
        "RSS MiB before/after:",
        {n: (round(rss_before[n]), round(rss_after[n])) for n in rss_before},
    )
    assert all(rss_after[n] - rss_before[n] < 200 for n in rss_before)


async def test_a_thousand_streams_cut_at_random_points_leak_no_block(serve):
    url = f"{serve.url}/v1/completions"
    rng = random.Random(0)
    body = {"model": serve.model, "max_tokens": 64, "ignore_eos": True}

    async def cut(session, prompt, events):
        payload = body | {"prompt": prompt, "stream": True}
        async with session.post(url, json=payload, headers=HEADERS) as response:
            assert response.status in (200, 429)
            for _ in range(events):
                if not await response.content.readline():
                    break
        # leaving the block closes the connection mid-stream

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(20):
            jobs = [
                cut(session, [rng.randrange(3, 384) for _ in range(rng.randint(1, 40))],
                    rng.randint(0, 8))
                for _ in range(50)
            ]  # fmt: skip
            await asyncio.gather(*jobs)
        cut_s = time.monotonic() - t0
        t1 = time.monotonic()
        await wait_metric(session, serve.url, "pagedserve_kv_blocks_used", 0, timeout=30)
        await wait_metric(session, serve.url, "pagedserve_num_requests_running", 0, timeout=30)
        settle_s = time.monotonic() - t1
        assert await metric(session, serve.url, "pagedserve_num_requests_waiting") == 0
    print(f"1000 cut streams in {cut_s:.1f} s; blocks and running back to 0 in {settle_s:.2f} s")


def test_a_request_over_the_timeout_ends_with_an_error_and_frees_its_blocks(tiny_model_dir):
    stack = ServeProcess(tiny_model_dir, "--num-device-blocks", "64", "--request-timeout", "2")
    try:
        url = f"{stack.url}/v1/completions"
        body = {"model": stack.model, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True}

        async def run():
            async with aiohttp.ClientSession() as session:
                paused = {}

                def on_event() -> None:
                    if not paused:  # running: hold the executor past the timeout
                        paused["t"] = time.monotonic()
                        os.kill(stack.pids["executor"], signal.SIGSTOP)

                try:
                    result = await stream(session, url, body, on_event)
                finally:
                    os.kill(stack.pids["executor"], signal.SIGCONT)
                await wait_metric(session, stack.url, "pagedserve_kv_blocks_used", 0)
                return result

        result = asyncio.run(run())
        assert result["done"] and result["error"]["code"] == "request_timeout"
        assert result["error"]["type"] == "timeout_error"
    finally:
        assert stack.stop() == 0
