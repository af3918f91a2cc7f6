"""The whole product: `pagedserve serve` (three processes) on a tiny model, spoken to over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import aiohttp
import pytest

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.service.stack_process import (
    API_KEY,
    HEADERS,
    metric,
    stream_completion,
    wait_metric,
)
from tests.support.polling import eventually


async def test_openai_client_streams_chat_and_completions(stack):
    import openai

    url, model, _ = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY)
    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "what is the capital"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for chunk in chat:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens >= 1
    completion = await client.completions.create(
        model=model, prompt="the capital of", max_tokens=6, stream=True
    )
    texts = [c.choices[0].text async for c in completion if c.choices]
    assert texts
    whole = await client.completions.create(model=model, prompt="the page", max_tokens=5)
    assert whole.usage.completion_tokens <= 5
    assert whole.choices[0].finish_reason in ("stop", "length")
    await client.close()


async def test_streamed_greedy_text_equals_the_in_process_engine(stack, tiny_model_dir, prompts):
    url, model, _ = stack
    async with aiohttp.ClientSession() as session:
        streamed = await asyncio.gather(
            *(stream_completion(session, url, model, p, 10) for p in prompts[:6])
        )
    engine = LLMEngine(engine_config(tiny_model_dir))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for (text, finish), out in zip(streamed, engine.generate(prompts[:6], greedy)):
        assert text == engine.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert finish == "length"


async def test_beam_search_through_the_openai_client(stack, tiny_model_dir, prompts):
    import openai

    url, model, _ = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    beam = {"use_beam_search": True, "length_penalty": 1.0, "early_stopping": False}
    reply = await client.completions.create(
        model=model, prompt=prompts[4], max_tokens=8, n=4, extra_body=beam
    )
    engine = LLMEngine(engine_config(tiny_model_dir))
    sampling = SamplingParams(n=4, max_tokens=8, temperature=0.0, use_beam_search=True)
    (expected,) = engine.generate([prompts[4]], sampling)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [
        engine.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in expected.outputs
    ]
    scores = [c.model_extra["cumulative_logprob"] for c in reply.choices]
    assert scores == pytest.approx([o.cumulative_logprob for o in expected.outputs])
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)

    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the capital"}],
        max_tokens=6,
        n=2,
        extra_body=beam,
    )
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(
            model=model, prompt="x", max_tokens=4, n=2, stream=True, extra_body=beam
        )
    assert "beam search cannot be streamed" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(
            model=model, prompt="x", max_tokens=4, n=2, temperature=0.8, extra_body=beam
        )
    assert "temperature" in str(error.value)
    await client.close()


async def test_32_concurrent_streams_complete_with_continuous_batching(stack, prompts):
    url, model, plan_log = stack
    before = len(plan_log.read_text().splitlines()) if plan_log.exists() else 0
    lengths = [4 + (7 * i) % 29 for i in range(32)]  # different lengths: requests end apart
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(
            *(
                stream_completion(session, url, model, prompts[i % len(prompts)][:20], n)
                for i, n in enumerate(lengths)
            )
        )
    assert all(finish == "length" for _, finish in results)
    steps = [json.loads(line) for line in plan_log.read_text().splitlines()[before:]]
    batches = [set(s["requests"]) for s in steps]
    # Iteration-level batching: some step admits a request while others keep running, right
    # after another one left (not waves that drain completely before the next batch starts).
    joined_mid_run = [
        i
        for i in range(1, len(batches))
        if batches[i] - batches[i - 1] and batches[i] & batches[i - 1]
    ]
    assert joined_mid_run
    assert max(len(b) for b in batches) <= 8  # --max-num-seqs


async def test_a_repeated_prompt_is_served_from_the_prefix_cache(stack):
    # 40 tokens: two full blocks of 16 that the second request finds (the default is on).
    url, model, _ = stack
    prompt = list(range(100, 140))
    names = ("pagedserve_prefix_cache_hit_tokens_total", "pagedserve_prefix_cache_blocks")
    async with aiohttp.ClientSession() as session:
        hits_before = await metric(session, url, names[0])
        first, _ = await stream_completion(session, url, model, prompt, 4)
        second, _ = await stream_completion(session, url, model, prompt, 4)
        assert second == first

        async def two_blocks_hit() -> bool:
            return await metric(session, url, names[0]) - hits_before >= 32

        await eventually(two_blocks_hit, 10.0, 0.1, "the repeated prompt hit no cached blocks")
        assert await metric(session, url, names[0]) - hits_before == 32
        assert await metric(session, url, names[1]) >= 2


async def test_cut_streams_free_every_block(stack, prompts):
    url, model, _ = stack
    body = {"model": model, "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def cut(session, prompt):
        payload = {**body, "prompt": prompt}
        async with session.post(f"{url}/v1/completions", json=payload, headers=HEADERS) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first event has arrived: the request is running

    async with aiohttp.ClientSession() as session:
        for start in range(0, 100, 20):
            batch = [prompts[i % 12][:30] for i in range(start, start + 20)]
            await asyncio.gather(*(cut(session, prompt) for prompt in batch))
        await wait_metric(session, url, "pagedserve_kv_blocks_used", 0, timeout=20.0)
        assert await metric(session, url, "pagedserve_kv_blocks_used") == 0
        assert await metric(session, url, "pagedserve_num_requests_running") == 0


@pytest.mark.parametrize(
    "path, body, headers, status, param",
    [
        ("/v1/completions", "{not json", HEADERS, 400, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, HEADERS, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, HEADERS, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, HEADERS, 400, "temperature"),
        ("/v1/completions", {"prompt": ""}, HEADERS, 400, "prompt"),
        ("/v1/completions", {"prompt": [5] * 5000}, HEADERS, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "nope"}, HEADERS, 404, "model"),
        ("/v1/completions", {"prompt": "hi"}, {}, 401, None),
        ("/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, None),
        ("/v1/chat/completions", {"messages": "hi"}, HEADERS, 400, "messages"),
    ],
)
async def test_bad_input_gets_its_status_and_the_server_keeps_serving(
    stack, path, body, headers, status, param
):
    url, model, _ = stack
    async with aiohttp.ClientSession() as session:
        if isinstance(body, dict):
            body = json.dumps({"model": model, **body})
        hdrs = {"Content-Type": "application/json", **headers}
        async with session.post(f"{url}{path}", data=body, headers=hdrs) as response:
            assert response.status == status
            error = (await response.json())["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param
        text, finish = await stream_completion(session, url, model, [5, 6, 7], 3)
        assert finish == "length"


def test_health_and_models(stack):
    import urllib.request

    url, model, _ = stack
    with urllib.request.urlopen(f"{url}/health") as response:
        assert response.status == 200
    request = urllib.request.Request(f"{url}/v1/models", headers=HEADERS)
    with urllib.request.urlopen(request) as response:
        listing = json.loads(response.read())
    assert [m["id"] for m in listing["data"]] == [model]


def test_serve_exits_nonzero_with_a_clear_message_when_a_process_cannot_start(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", str(tmp_path / "missing")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert proc.returncode != 0
    assert "not found" in proc.stderr


def test_serve_reports_a_process_that_fails_to_start(tiny_model_dir):
    with socket.socket() as taken:  # the gateway cannot bind a port that is in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_model_dir),
                "--port", str(port), "--num-device-blocks", "64"]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "gateway process exited" in proc.stderr
