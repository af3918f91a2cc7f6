"""The HTTP load generator against the gateway app (scripted backend): timings and token counts."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from services.bench.http_load import run_load, scrape_kv_fractions
from services.bench.traces import TraceRequest
from services.gateway.app import create_app
from tests.factories import make_tiny_tokenizer
from tests.support.gateway_fakes import FakeBackend


async def test_run_load_streams_every_request_at_its_arrival() -> None:
    tokenizer = make_tiny_tokenizer(384)
    backend = FakeBackend(tokenizer)
    backend.current_stats.kv_fractions_avg = {"token_states": 0.75, "free": 0.25}
    client = TestClient(TestServer(create_app(backend, tokenizer)))
    await client.start_server()
    try:
        url = str(client.make_url("")).rstrip("/")
        trace = [
            TraceRequest(0.0, (5, 6, 7), 3),
            TraceRequest(0.2, (8, 9), 4),
            TraceRequest(0.1, (10,), 2),
        ]
        records, duration = await run_load(url, trace)
        fractions = await scrape_kv_fractions(url)
    finally:
        await client.close()
    by_prompt = {r.prompt_len: r for r in records}
    assert {k: v.output_len for k, v in by_prompt.items()} == {3: 3, 2: 4, 1: 2}
    assert all(r.finish_reason == "length" for r in records)
    assert by_prompt[2].arrival_s >= 0.2 and by_prompt[1].arrival_s >= 0.1
    for r in records:
        assert r.arrival_s < r.first_token_s <= r.finish_s <= duration + r.arrival_s + 1e-6
    assert [q.sampling.ignore_eos for q in backend.requests] == [True, True, True]
    assert fractions == {"token_states": 0.75, "free": 0.25}
