"""Scheduler and executor as real processes, driven through the gateway's ZeroMQ backend."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest

from services.engine.llm_engine import LLMEngine
from services.gateway.zmq_backend import ZmqBackend
from shared.ipc import Addresses
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams
from tests.factories import engine_config

ENGINE_FLAGS = ["--num-device-blocks", "64", "--max-num-batched-tokens", "64"]


@pytest.fixture
async def backend(tiny_model_dir, tmp_path):
    addresses = Addresses.ipc(str(tmp_path / "ipc"))
    wires = [
        "--requests-addr", addresses.requests,
        "--deltas-addr", addresses.deltas,
        "--plans-addr", addresses.plans,
        "--results-addr", addresses.results,
    ]  # fmt: skip
    common = ["--model", str(tiny_model_dir), *ENGINE_FLAGS, *wires]
    procs = [
        subprocess.Popen([sys.executable, "-m", "services.scheduler", *common]),
        subprocess.Popen([sys.executable, "-m", "services.executor", *common]),
    ]
    client = ZmqBackend(addresses)
    await client.start()
    try:
        for _ in range(300):
            if client.ready:
                break
            await asyncio.sleep(0.1)
        assert client.ready, "backend did not become ready"
        yield client
    finally:
        await client.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


async def _collect(backend, prompt, sampling):
    request = GenerateRequest(uuid.uuid4().hex, prompt, sampling, 0.0)
    tokens: dict[int, list[int]] = {}
    last = None
    async for delta in backend.generate(request):
        for seq in delta.seqs:
            tokens.setdefault(seq.index, []).extend(seq.token_ids)
        last = delta
    return tokens, last


async def test_streamed_tokens_equal_the_in_process_engine(backend, tiny_model_dir, prompts):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = await asyncio.gather(*(_collect(backend, p, greedy) for p in prompts[:8]))
    expected = LLMEngine(engine_config(tiny_model_dir)).generate(prompts[:8], greedy)
    for (tokens, last), want in zip(results, expected):
        assert tokens == {0: want.outputs[0].token_ids}
        assert last.finished and last.seqs[0].finish_reason == "length"
    for _ in range(30):  # the next heartbeat reports the freed pool
        if backend.stats.kv_blocks_used == 0:
            break
        await asyncio.sleep(0.1)
    assert backend.stats.kv_blocks_used == 0
    assert backend.stats.num_steps > 0


async def test_rejection_and_abort_reach_the_gateway(backend, prompts):
    tokens, last = await _collect(backend, [], SamplingParams(max_tokens=4))
    assert last.finished and last.error["type"] == "invalid_request_error"
    assert last.error["param"] == "prompt"

    request = GenerateRequest(
        "long-one", prompts[4], SamplingParams(max_tokens=400, ignore_eos=True), 0.0
    )
    stream = backend.generate(request)
    ack = await stream.__anext__()  # accepted: counted as waiting at the scheduler from now on
    assert ack.seqs == [] and not ack.finished and ack.num_prompt_tokens == len(prompts[4])
    first = await stream.__anext__()
    assert first.seqs and not first.finished
    await backend.abort("long-one")
    async for delta in stream:
        last = delta
    assert last.finished and last.seqs[0].finish_reason == "abort"
    for _ in range(30):
        if backend.stats.kv_blocks_used == 0:
            break
        await asyncio.sleep(0.1)
    assert backend.stats.kv_blocks_used == 0
