"""Replicas: one gateway, two scheduler+executor stacks; routing, health, per-replica metrics."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from services.engine.llm_engine import LLMEngine
from services.gateway.backend import BackendGone
from services.gateway.replicas import ReplicaRouter
from shared.protocol import GenerateRequest, RequestDelta, SeqDelta
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.service.stack_process import HEADERS, ServeProcess, stream_completion


class FakeReplica:
    def __init__(self) -> None:
        self.ready = True
        self.info = None
        self.stats = None
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, request: GenerateRequest):
        yield RequestDelta(request.request_id, [SeqDelta(0, [5])], False)
        await self.release.wait()
        yield RequestDelta(request.request_id, [SeqDelta(0, [6], finish_reason="stop")], True)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _request(rid: str, prompt_len: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, [7] * prompt_len, SamplingParams(max_tokens=max_tokens), 0.0)


async def test_router_picks_the_least_loaded_ready_replica_and_aborts_at_the_owner():
    a, b = FakeReplica(), FakeReplica()
    router = ReplicaRouter([a, b])
    big = router.generate(_request("big", 100, 50))
    assert (await anext(big)).request_id == "big"  # on replica 0 (tie: lowest index)
    small = router.generate(_request("small", 10, 5))
    await anext(small)  # replica 1 owes fewer tokens
    assert router.outstanding == [150, 15] and router.routed == [1, 1]
    third = router.generate(_request("third", 10, 5))
    await anext(third)
    assert router.routed == [1, 2]
    b.ready = False  # a replica that is down gets nothing new
    assert router.degraded and router.pick() == 0
    await big.aclose()  # the client left: the abort must still reach replica 0
    await router.abort("big")
    assert a.aborted == ["big"] and router.outstanding[0] == 0
    a.ready = False
    assert not router.ready
    with pytest.raises(BackendGone):
        router.pick()
    b.release.set()
    assert (await anext(small)).finished


@pytest.fixture(scope="module")
def replica_stack(tiny_model_dir):
    serve = ServeProcess(
        tiny_model_dir, "--replicas", "2", "--num-device-blocks", "128",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
    )  # fmt: skip
    try:
        yield serve.url, serve.model, serve.proc
    finally:
        assert serve.stop() == 0


async def test_two_replicas_serve_32_streams_with_identical_greedy_outputs(
    replica_stack, tiny_model_dir
):
    url, model, _ = replica_stack
    prompts = random_prompts([5 + 3 * i for i in range(32)], 384, seed=9)
    async with aiohttp.ClientSession() as session:
        streamed = await asyncio.gather(
            *(stream_completion(session, url, model, p, 8) for p in prompts)
        )
        async with session.get(f"{url}/metrics", headers=HEADERS) as response:
            metrics = await response.text()
        async with session.get(f"{url}/health") as response:
            assert (await response.json())["status"] == "ok"
    engine = LLMEngine(engine_config(tiny_model_dir))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for (text, finish), out in zip(streamed, engine.generate(prompts, greedy)):
        assert text == engine.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert finish == "length"
    routed = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^pagedserve_replica_requests_total\{replica="(\d)"\} ([0-9.e+]+)$', metrics, re.M
        )
    }
    assert set(routed) == {"0", "1"} and all(v > 0 for v in routed.values())
    assert sum(routed.values()) >= 32


async def test_health_says_degraded_while_a_replica_is_down():
    from aiohttp.test_utils import TestClient, TestServer

    from services.gateway.app import create_app
    from tests.factories import make_tiny_tokenizer

    a, b = FakeReplica(), FakeReplica()
    client = TestClient(TestServer(create_app(ReplicaRouter([a, b]), make_tiny_tokenizer(384))))
    await client.start_server()
    try:
        assert (await (await client.get("/health")).json())["status"] == "ok"
        b.ready = False
        response = await client.get("/health")
        assert response.status == 200 and (await response.json())["status"] == "degraded"
        metrics = await (await client.get("/metrics")).text()
        assert 'pagedserve_replica_up{replica="1"} 0.0' in metrics
        a.ready = False
        assert (await client.get("/health")).status == 503
    finally:
        await client.close()
