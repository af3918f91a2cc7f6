"""`pagedserve serve --gateways 2`: two gateway processes share the port and one scheduler; each
streams only its own requests, /metrics sums both, a killed one loses only its streams, and
both serve again once a killed scheduler is replaced."""

from __future__ import annotations

import asyncio
import re

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
from tests.support.polling import eventually

PROMPTS = [[5 + i, 17, 40 + 3 * (i % 4), 9, 33 + i % 4] for i in range(16)]


@pytest.fixture(scope="module")
def serve(tiny_model_dir):
    stack = ServeProcess(
        tiny_model_dir, "--gateways", "2", "--num-device-blocks", "256", "--max-num-seqs", "16",
        "--max-restarts", "3",
    )  # fmt: skip
    yield stack
    assert stack.stop() == 0


def _session() -> aiohttp.ClientSession:
    # A new connection per request, so that the kernel spreads them over both gateways.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def test_two_gateways_serve_and_count_together(serve):
    assert {"gateway", "gateway-1"} <= set(serve.pids)
    url = f"{serve.url}/v1/completions"
    body = {"model": serve.model, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with _session() as session:
        results = await asyncio.gather(
            *(stream(session, url, body | {"prompt": p}) for p in PROMPTS)
        )
        assert all(r["done"] and r["error"] is None for r in results)
        # Greedy: the same prompt, on whichever gateway, gives the same text.
        again = await stream(session, url, body | {"prompt": PROMPTS[3]})
        assert again["texts"] == results[3]["texts"]
        # Whichever gateway answers the scrape, the counts are the sums over both.
        for _ in range(6):
            finished = await metric(
                session, serve.url, 'pagedserve_requests_finished_total{finish_reason="length"}'
            )
            assert finished == len(PROMPTS) + 1
        await wait_metric(session, serve.url, "pagedserve_kv_blocks_used", 0)


async def test_a_killed_gateway_loses_only_its_own_streams(serve):
    url = f"{serve.url}/v1/completions"
    body = {"model": serve.model, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    async with _session() as session:
        expected = await asyncio.gather(
            *(stream(session, url, body | {"prompt": p}) for p in PROMPTS)
        )
        started = asyncio.Event()
        counts = {"n": 0}

        def on_event() -> None:
            counts["n"] += 1
            if counts["n"] >= 3 * len(PROMPTS):
                started.set()

        streams = [
            asyncio.ensure_future(stream(session, url, body | {"prompt": p}, on_event))
            for p in PROMPTS
        ]
        await asyncio.wait_for(started.wait(), 60)
        restarts = len(serve.restarts)
        serve.kill("gateway-1")
        results = await asyncio.gather(*streams, return_exceptions=True)
        survived = [
            i for i, r in enumerate(results) if isinstance(r, dict) and r["done"] and not r["error"]
        ]
        # 16 connections over two processes: both got some (all on one: p = 2 / 65,536).
        assert 0 < len(survived) < len(PROMPTS), results
        for i in survived:
            assert results[i]["texts"] == expected[i]["texts"]
        serve.wait_restarted(restarts + 1)
        assert serve.restarts[-1] == "gateway-1"
        await wait_health(session, serve.url)
        # The dead gateway's requests were aborted: nothing decodes for nobody.
        await wait_metric(session, serve.url, "pagedserve_num_requests_running", 0)
        await wait_metric(session, serve.url, "pagedserve_kv_blocks_used", 0)


async def test_both_gateways_serve_again_after_the_scheduler_is_replaced(serve):
    url = f"{serve.url}/v1/completions"
    body = {"model": serve.model, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    restarts = len(serve.restarts)
    serve.kill("scheduler")
    serve.wait_restarted(restarts + 1)
    assert serve.restarts[-1] == "scheduler"
    async with _session() as session:
        # Each gateway says hello to the new scheduler when its connection reopens; until
        # both are announced, some fresh connections would get 503.
        results: list[dict] = []

        async def every_prompt_served() -> bool:
            results[:] = await asyncio.gather(
                *(stream(session, url, body | {"prompt": p}) for p in PROMPTS)
            )
            return all(r["done"] and r["error"] is None for r in results)

        await eventually(every_prompt_served, 60.0, 0.5, lambda: f"results: {results}")
        await wait_metric(session, serve.url, "pagedserve_kv_blocks_used", 0)


def test_requests_routed_per_replica_are_counted_over_every_gateway(tiny_model_dir):
    # Each gateway routes over both replicas; /metrics from either must show all routings.
    stack = ServeProcess(
        tiny_model_dir, "--gateways", "2", "--replicas", "2", "--num-device-blocks", "128",
        "--max-num-seqs", "8",
    )  # fmt: skip
    try:

        async def run() -> list[float]:
            url = f"{stack.url}/v1/completions"
            body = {"model": stack.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            async with _session() as session:
                results = await asyncio.gather(
                    *(stream(session, url, body | {"prompt": p}) for p in PROMPTS)
                )
                assert all(r["done"] and r["error"] is None for r in results)
                totals = []
                for _ in range(6):  # scrapes land on either gateway
                    async with session.get(f"{stack.url}/metrics", headers=HEADERS) as response:
                        text = await response.text()
                    pattern = r'^pagedserve_replica_requests_total\{replica="\d"\} ([0-9.e+]+)$'
                    totals.append(sum(float(v) for v in re.findall(pattern, text, re.M)))
                return totals

        assert asyncio.run(run()) == [len(PROMPTS)] * 6
    finally:
        assert stack.stop() == 0
