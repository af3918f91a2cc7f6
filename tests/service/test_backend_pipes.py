"""Scheduler and executor as real processes, driven through the gateway's ZeroMQ backend."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest
import zmq
import zmq.asyncio

from services.engine.llm_engine import LLMEngine
from services.gateway.zmq_backend import ZmqBackend
from shared.ipc import Addresses, make_socket, recv, send
from shared.protocol import GatewayHello, GenerateRequest, TokenDeltas
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.polling import eventually

ENGINE_FLAGS = ["--num-device-blocks", "64", "--max-num-batched-tokens", "64"]


@pytest.fixture
def addresses(tmp_path):
    return Addresses.ipc(str(tmp_path / "ipc"))


@pytest.fixture
async def backend(tiny_model_dir, addresses):
    wires = [
        "--gateway-addr", addresses.gateway,
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
        await eventually(lambda: client.ready, 30.0, 0.1, "backend did not become ready")
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
    # The next heartbeat reports the freed pool.
    await eventually(lambda: backend.stats.kv_blocks_used == 0, 3.0, 0.1, "blocks still used")
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
    await _abort_and_expect_freed(backend, stream, "long-one")


async def _abort_and_expect_freed(backend, stream, request_id: str) -> None:
    """Abort a decoding request: its stream ends with "abort" and the pool empties."""
    await backend.abort(request_id)
    async for delta in stream:
        last = delta
    assert last.finished and last.seqs[0].finish_reason == "abort"
    # The next heartbeat reports the freed pool.
    await eventually(lambda: backend.stats.kv_blocks_used == 0, 3.0, 0.1, "blocks still used")


async def _ready_client(addresses) -> ZmqBackend:
    client = ZmqBackend(addresses)
    await client.start()
    message = "a second gateway never got the scheduler's announcement"
    await eventually(lambda: client.ready, 10.0, 0.1, message)
    return client


async def test_two_gateways_each_get_only_their_own_requests_deltas(
    backend, addresses, tiny_model_dir, prompts
):
    # A raw second gateway, to see every delta the scheduler sends it.
    ctx = zmq.asyncio.Context()
    raw = make_socket(ctx, zmq.DEALER, addresses.gateway, bind=False)
    try:
        greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        await send(raw, GatewayHello())
        mine = {f"raw-{i}": p for i, p in enumerate(prompts[:4])}
        for request_id, prompt in mine.items():
            await send(raw, GenerateRequest(request_id, prompt, greedy, 0.0))

        async def read_raw() -> tuple[dict[str, list[int]], set[str]]:
            tokens: dict[str, list[int]] = {r: [] for r in mine}
            seen, done = set(), set()
            while done != set(mine):
                message = await recv(raw)
                if isinstance(message, TokenDeltas):
                    for delta in message.all_deltas():  # the columns' too
                        seen.add(delta.request_id)
                        for seq in delta.seqs:
                            tokens[delta.request_id].extend(seq.token_ids)
                        if delta.finished:
                            done.add(delta.request_id)
            return tokens, seen

        theirs = asyncio.gather(*(_collect(backend, p, greedy) for p in prompts[4:8]))
        (raw_tokens, seen), results = await asyncio.wait_for(asyncio.gather(read_raw(), theirs), 60)
        assert seen == set(mine)  # none of the other gateway's requests
        expected = LLMEngine(engine_config(tiny_model_dir)).generate(prompts[:8], greedy)
        assert [raw_tokens[r] for r in mine] == [e.outputs[0].token_ids for e in expected[:4]]
        for (tokens, last), want in zip(results, expected[4:]):
            assert tokens == {0: want.outputs[0].token_ids} and last.finished
    finally:
        ctx.destroy(linger=0)


async def test_a_gateway_that_leaves_frees_its_requests_and_no_others(backend, addresses, prompts):
    other = await _ready_client(addresses)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    leaving = other.generate(GenerateRequest("leaving", prompts[1], long, 0.0))
    staying = backend.generate(GenerateRequest("staying", prompts[2], long, 0.0))
    for stream in (leaving, staying):
        await stream.__anext__()  # acknowledged
        assert (await stream.__anext__()).seqs  # decoding
    await leaving.aclose()
    await other.close()  # the process "dies": its connection closes without an abort
    # The scheduler aborts the orphan: one running sequence is left.
    await eventually(lambda: backend.stats.num_running == 1, 5.0, 0.1, "the orphan still runs")
    more = await staying.__anext__()
    assert more.seqs and not more.finished  # the other gateway's request goes on
    await _abort_and_expect_freed(backend, staying, "staying")
