"""Poisson load over HTTP/SSE against a running gateway: one streamed completion per request."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from services.bench.replay import RequestRecord
from services.bench.traces import TraceRequest


async def model_name(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, request: TraceRequest, start: float
) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    record = RequestRecord(time.perf_counter() - start, request.prompt_len, 0)
    body = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            record.finish_reason = f"http {resp.status}"
            return record
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                record.finish_reason = "error"
                break
            for choice in chunk.get("choices", []):
                text = choice.get("text") or ""
                # A chunk without text (a server's opening or role chunk) is not a token yet.
                if record.first_token_s is None and (text or choice.get("finish_reason")):
                    record.first_token_s = time.perf_counter() - start
                record.text += text
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            if chunk.get("usage"):
                record.output_len = chunk["usage"]["completion_tokens"]
    record.finish_s = time.perf_counter() - start
    return record


async def run_load(
    url: str,
    trace: list[TraceRequest],
    api_key: str | None = None,
    progress: bool = False,
    max_concurrency: int | None = None,
    fresh_connections: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time, with at most max_concurrency in flight (a request
    over it is sent, and its latencies start, once one ends); returns the records and the run's
    duration. fresh_connections: one connection per request (llama-server may close an idle
    kept-alive connection just as the client reuses it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None)
    # As many open streams as requests in flight.
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector
    ) as session:
        model = await model_name(session, url)
        start = time.perf_counter()
        slots = asyncio.Semaphore(max_concurrency or len(trace) or 1)

        async def bounded(request: TraceRequest) -> RequestRecord:
            async with slots:
                return await _one(session, url, model, request, start)

        tasks = [asyncio.create_task(bounded(r)) for r in trace]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), desc="requests", unit="req", leave=False)
        records = []
        for task in asyncio.as_completed(tasks):
            records.append(await task)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        duration = max((r.finish_s or 0.0) for r in records) - min(r.arrival_s for r in records)
    return records, duration


async def scrape_kv_fractions(url: str) -> dict[str, float]:
    """The gateway's time-averaged KV fractions since the server started."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
    fractions = {}
    prefix = 'pagedserve_kv_memory_fraction_avg{kind="'
    for line in text.splitlines():
        if line.startswith(prefix):
            kind, value = line[len(prefix) :].split('"} ')
            fractions[kind] = float(value)
    return fractions
