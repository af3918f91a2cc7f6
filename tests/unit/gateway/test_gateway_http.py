"""The gateway's OpenAI HTTP API against a scripted fake backend: bodies, streams, errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from services.gateway import serving
from services.gateway.app import create_app
from tests.support.gateway_fakes import (
    CHAT,
    INFO,
    REPLY,
    FakeBackend,
    chat,
    completion,
    post_sse,
)
from tests.support.polling import eventually

# ---- success paths ----------------------------------------------------------------------------


async def test_completion_json(serve, tokenizer) -> None:
    client, backend = await serve()
    resp = await client.post("/v1/completions", json=completion(seed=7, top_k=5, ignore_eos=True))
    assert resp.status == 200
    body = await resp.json()
    reply = tokenizer.encode(REPLY)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": tokenizer.decode(reply[:5]),
        "logprobs": None,
        "finish_reason": "length",
    }
    prompt = tokenizer.encode("the capital of")
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 5,
        "total_tokens": len(prompt) + 5,
    }
    [request] = backend.requests
    assert request.request_id == body["id"] and request.prompt_token_ids == prompt
    sp = request.sampling
    assert (sp.max_tokens, sp.seed, sp.top_k, sp.ignore_eos, sp.n) == (5, 7, 5, True, 1)
    assert backend.aborted == []


async def test_completion_token_prompts(serve) -> None:
    client, backend = await serve()
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        resp = await client.post("/v1/completions", json=completion(prompt=prompt))
        assert resp.status == 200
        assert backend.requests[-1].prompt_token_ids == [5, 6, 7]
    resp = await client.post("/v1/completions", json=completion(prompt=["one", "two"]))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["message"] == "only one prompt per request is supported"
    assert error["param"] == "prompt"


async def test_completion_stream(serve, tokenizer) -> None:
    client, _ = await serve()
    events = await post_sse(client, "/v1/completions", completion(max_tokens=50))
    assert len(events) >= 2
    assert {e["object"] for e in events} == {"text_completion"}
    assert len({e["id"] for e in events}) == 1 and "usage" not in events[0]
    assert "".join(e["choices"][0]["text"] for e in events) == tokenizer.decode(
        tokenizer.encode(REPLY)
    )
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


async def test_stream_include_usage(serve) -> None:
    client, _ = await serve()
    body = completion(stream_options={"include_usage": True})
    events = await post_sse(client, "/v1/completions", body)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert all(c["usage"] is None for c in chunks)


async def test_chat_json(serve, tokenizer) -> None:
    client, backend = await serve()
    resp = await client.post("/v1/chat/completions", json=chat())
    body = await resp.json()
    assert resp.status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(tokenizer.encode(REPLY))
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    [request] = backend.requests
    assert request.prompt_token_ids == list(expected["input_ids"])
    # No max_tokens: the rest of the context.
    assert request.sampling.max_tokens == INFO.executor.max_model_len - len(expected["input_ids"])


async def test_chat_stream_with_text_parts(serve, tokenizer) -> None:
    client, backend = await serve()
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    events = await post_sse(client, "/v1/chat/completions", chat(messages=parts, max_tokens=4))
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    text = "".join(d.get("content", "") for d in deltas)
    assert text == tokenizer.decode(tokenizer.encode(REPLY)[:4])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert backend.requests[0].sampling.max_tokens == 4


async def test_n2(serve, tokenizer) -> None:
    client, backend = await serve()
    backend.replies = [tokenizer.encode(REPLY), tokenizer.encode(" memory block page")]
    resp = await client.post("/v1/completions", json=completion(n=2, max_tokens=20))
    body = await resp.json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [REPLY, " memory block page"]
    tokens = sum(len(r) for r in backend.replies)
    assert body["usage"]["completion_tokens"] == tokens

    events = await post_sse(client, "/v1/chat/completions", chat(n=2))
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for event in events:
        [choice] = event["choices"]
        by_index[choice["index"]].append(choice)
    for index, choices in by_index.items():
        assert choices[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in choices) == texts[index]
        assert choices[-1]["finish_reason"] == "stop"


async def test_logprobs_shapes(serve, tokenizer) -> None:
    client, backend = await serve()
    resp = await client.post("/v1/completions", json=completion(logprobs=2))
    [choice] = (await resp.json())["choices"]
    lp = choice["logprobs"]
    assert backend.requests[-1].sampling.logprobs == 2
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"] == [-0.5] * 5
    assert all(
        len(top) <= 2 and all(isinstance(v, float) for v in top.values())
        for top in lp["top_logprobs"]
    )
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert lp["text_offset"] == offsets

    events = await post_sse(client, "/v1/completions", completion(logprobs=1, echo=True))
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    # Echo with logprobs: the prompt's tokens come first (the first with a null logprob).
    num_prompt = len(backend.requests[-1].prompt_token_ids)
    assert streamed[num_prompt:] == lp["tokens"]
    assert "".join(streamed[:num_prompt]) == "the capital of"
    echoed = events[0]["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][:num_prompt] == [None] + [-1.0] * (num_prompt - 1)
    assert echoed["text_offset"][0] == 0
    assert echoed["text_offset"][num_prompt] == len("the capital of")

    resp = await client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2))
    content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert backend.requests[-1].sampling.logprobs == 2
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["bytes"] == list(first["token"].encode())
    assert len(first["top_logprobs"]) == 2
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}

    events = await post_sse(client, "/v1/chat/completions", chat(logprobs=True))
    assert all(
        e["choices"][0]["logprobs"] is not None
        for e in events
        if e["choices"][0]["delta"].get("content")
    )
    assert backend.requests[-1].sampling.logprobs == 0


async def test_echo(serve, tokenizer) -> None:
    client, _ = await serve()
    resp = await client.post("/v1/completions", json=completion(echo=True))
    text = (await resp.json())["choices"][0]["text"]
    assert text == "the capital of" + tokenizer.decode(tokenizer.encode(REPLY)[:5])
    events = await post_sse(client, "/v1/completions", completion(echo=True))
    assert events[0]["choices"][0]["text"].startswith("the capital of")
    assert "".join(e["choices"][0]["text"] for e in events) == text
    resp = await client.post("/v1/completions", json=completion(prompt=[5, 6], echo=True))
    assert (await resp.json())["choices"][0]["text"].startswith(tokenizer.decode([5, 6]))


async def test_stop_string_cuts_and_aborts(serve, tokenizer) -> None:
    client, backend = await serve()
    resp = await client.post("/v1/completions", json=completion(max_tokens=50, stop=" fr"))
    body = await resp.json()
    assert body["choices"][0]["text"] == " the capital of"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < len(tokenizer.encode(REPLY))
    await eventually(lambda: backend.aborted == [body["id"]])

    events = await post_sse(client, "/v1/chat/completions", chat(stop=["zzz", "ital o"]))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == " the cap"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    await eventually(lambda: len(backend.aborted) == 2)
    assert backend.aborted[1] == events[0]["id"]


async def test_stop_string_in_one_of_two_samples(serve, tokenizer) -> None:
    client, backend = await serve()
    backend.replies = [tokenizer.encode(REPLY), tokenizer.encode(" memory block page")]
    resp = await client.post("/v1/completions", json=completion(n=2, max_tokens=20, stop="block"))
    choices = sorted((await resp.json())["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [REPLY, " memory "]
    assert [c["finish_reason"] for c in choices] == ["stop", "stop"]
    assert backend.aborted == []  # the group finished at the backend by itself

    # Both samples stopped early: the gateway ends the whole request at the backend.
    resp = await client.post("/v1/completions", json=completion(n=2, max_tokens=20, stop="a"))
    body = await resp.json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [" the c", " memory block p"]
    await eventually(lambda: backend.aborted == [body["id"]])


# ---- errors -----------------------------------------------------------------------------------

LONG = [5] * 512  # max_seq_len = min(512, 64 * 16): no room to generate


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", completion(max_tokens="5"), "max_tokens", None),
        ("/v1/completions", completion(temperature="hot"), "temperature", None),
        ("/v1/completions", completion(stream="yes"), "stream", None),
        ("/v1/completions", completion(stop=5), "stop", None),
        ("/v1/completions", completion(prompt={"a": 1}), "prompt", "invalid_type"),
        ("/v1/completions", completion(prompt=[1, "x"]), "prompt", "invalid_type"),
        ("/v1/chat/completions", chat(messages="hi"), "messages", None),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 3}]), "messages", None),
        ("/v1/chat/completions", chat(logprobs=1), "logprobs", None),
        ("/v1/completions", completion(temperature=-1), "temperature", None),
        ("/v1/completions", completion(top_p=1.5), "top_p", None),
        ("/v1/completions", completion(n=0), "n", None),
        ("/v1/completions", completion(n=17), "n", None),  # > max_num_seqs
        ("/v1/completions", completion(max_tokens=0), "max_tokens", None),
        ("/v1/completions", completion(logprobs=6), "logprobs", None),
        ("/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), "stop", None),
        ("/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids", None),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs", None),
        ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs", None),
        ("/v1/chat/completions", chat(max_completion_tokens=0), "max_completion_tokens", None),
        ("/v1/completions", completion(prompt=""), "prompt", None),
        ("/v1/completions", completion(prompt=[]), "prompt", None),
        ("/v1/completions", completion(prompt=[384]), "prompt", None),
        ("/v1/completions", completion(prompt=LONG), "prompt", "context_length_exceeded"),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "the " * 600}]),
            "messages",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"prompt": "hi"}, "model", None),
    ],
)
async def test_invalid_request(serve, path, body, param, code) -> None:
    client, backend = await serve()
    resp = await client.post(path, json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert backend.requests == []


async def test_longest_prompt_is_accepted(serve) -> None:
    client, backend = await serve()
    resp = await client.post("/v1/completions", json=completion(prompt=LONG[:-1]))
    assert resp.status == 200
    assert len(backend.requests[0].prompt_token_ids) == 511


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
async def test_malformed_json(serve, data) -> None:
    client, _ = await serve()
    resp = await client.post("/v1/completions", data=data)
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_unknown_model(serve) -> None:
    client, _ = await serve()
    resp = await client.post("/v1/chat/completions", json=chat(model="gpt-4"))
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "not_found_error",
        "model",
        "model_not_found",
    )


async def test_api_key(serve) -> None:
    client, _ = await serve(api_key="sk-secret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-secret"}):
        resp = await client.post("/v1/completions", json=completion(), headers=headers)
        assert resp.status == 401
        assert (await resp.json())["error"]["type"] == "authentication_error"
    resp = await client.get("/v1/models")
    assert resp.status == 401
    ok = {"Authorization": "Bearer sk-secret"}
    assert (await client.post("/v1/completions", json=completion(), headers=ok)).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 401  # only /health is open
    assert (await client.get("/metrics", headers=ok)).status == 200


async def test_queue_limit(serve) -> None:
    client, backend = await serve(max_queued_requests=2)
    backend.current_stats.num_waiting = 2
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 429
    assert (await resp.json())["error"]["type"] == "rate_limit_error"
    assert backend.requests == []

    # One waiting at the scheduler plus one submitted here that has no delta yet: full.
    backend.current_stats.num_waiting = 1
    backend.hold_first = True
    stuck = asyncio.ensure_future(client.post("/v1/completions", json=completion()))
    await eventually(lambda: len(backend.requests) == 1)
    assert (await client.post("/v1/completions", json=completion())).status == 429
    stuck.cancel()
    await eventually(lambda: len(backend.aborted) == 1)
    backend.hold_first = False
    assert (await client.post("/v1/completions", json=completion())).status == 200


async def test_not_ready(serve) -> None:
    client, backend = await serve()
    backend.is_ready = False
    for resp in (
        await client.post("/v1/completions", json=completion()),
        await client.post("/v1/chat/completions", json=chat(stream=True)),
        await client.get("/health"),
    ):
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "service_unavailable_error"
    backend.is_ready = True
    assert await (await client.get("/health")).json() == {"status": "ok"}


async def test_scheduler_rejection(serve) -> None:
    client, backend = await serve()
    error = {
        "message": "prompt token id 999 is outside the vocabulary",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    backend.reject = error
    for stream in (False, True):
        resp = await client.post("/v1/completions", json=completion(stream=stream))
        assert resp.status == 400
        assert resp.content_type == "application/json"
        assert await resp.json() == {"error": error}
    assert backend.aborted == []


async def test_backend_gone(serve) -> None:
    client, backend = await serve()
    backend.gone_after = 2
    events = await post_sse(client, "/v1/completions", completion(max_tokens=10))
    assert len(events) == 3 and events[-1]["error"]["type"] == "service_unavailable_error"
    assert all("choices" in e for e in events[:-1])
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 503
    backend.gone_after = 0
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == 503 and resp.content_type == "application/json"


async def test_executor_failure(serve) -> None:
    client, backend = await serve()
    backend.fail_after = 2
    events = await post_sse(client, "/v1/chat/completions", chat(n=2))
    assert events[-1]["error"]["type"] == "internal_error"
    assert all("choices" in e for e in events[:-1])
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 500 and (await resp.json())["error"]["type"] == "internal_error"
    assert backend.aborted == []  # the scheduler already ended them


async def test_unexpected_error_is_500_without_details(serve) -> None:
    client, backend = await serve()
    backend.crash = RuntimeError("secret internals")
    resp = await client.post("/v1/completions", json=completion())
    assert resp.status == 500
    text = await resp.text()
    assert "secret" not in text and "Traceback" not in text
    assert json.loads(text)["error"]["type"] == "internal_error"


async def test_streaming_client_disconnect_aborts(serve, tokenizer) -> None:
    client, backend = await serve()
    backend.replies = [tokenizer.encode(REPLY * 20)]
    backend.delay = 0.05
    resp = await client.post("/v1/completions", json=completion(max_tokens=100, stream=True))
    line = await resp.content.readline()
    request_id = json.loads(line[len(b"data: ") :])["id"]
    resp.close()
    await eventually(lambda: backend.aborted == [request_id])


async def test_json_client_disconnect_aborts_without_handler_cancellation(
    tokenizer, monkeypatch
) -> None:
    # `web.run_app` does not cancel handlers when the client leaves; the gateway must notice.
    monkeypatch.setattr(serving, "DISCONNECT_POLL_S", 0.05)
    backend = FakeBackend(tokenizer)
    backend.hold_first = True
    runner = web.AppRunner(create_app(backend, tokenizer), handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json=completion(),
                    timeout=aiohttp.ClientTimeout(total=0.3),
                )
        await eventually(lambda: backend.aborted == [backend.requests[0].request_id])
    finally:
        await runner.cleanup()


# ---- models, health, metrics, official client -------------------------------------------------


async def test_models(serve) -> None:
    client, _ = await serve()
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "tiny" and card["object"] == "model"
    assert card["owned_by"] == "pagedserve" and card["max_model_len"] == 512
    assert (await client.get("/v1/models/tiny")).status == 200
    assert (await client.get("/v1/models/other")).status == 404
    resp = await client.get("/v1/nowhere")
    assert resp.status == 404 and "error" in await resp.json()


async def test_metrics(serve, tokenizer) -> None:
    client, _ = await serve()
    await client.post("/v1/completions", json=completion())
    await post_sse(client, "/v1/completions", completion(prompt=[5, 6, 7], max_tokens=3))
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["pagedserve_generation_tokens_total"] == 8
    prompt_tokens = len(tokenizer.encode("the capital of")) + 3
    assert samples["pagedserve_prompt_tokens_total"] == prompt_tokens
    assert samples['pagedserve_requests_finished_total{finish_reason="length"}'] == 2
    assert samples["pagedserve_num_preemptions_total"] == 3
    assert samples["pagedserve_num_requests_running"] == 2
    assert samples["pagedserve_num_requests_waiting"] == 0
    assert samples["pagedserve_num_requests_swapped"] == 0
    assert samples["pagedserve_kv_blocks_used"] == 16
    assert samples["pagedserve_kv_cache_usage_ratio"] == 0.25
    assert samples["pagedserve_time_to_first_token_seconds_count"] == 2
    assert samples["pagedserve_time_per_output_token_seconds_count"] == 2
    assert samples["pagedserve_e2e_request_latency_seconds_count"] == 2


async def test_openai_client(serve, tokenizer) -> None:
    openai = pytest.importorskip("openai")
    client, _ = await serve(api_key="sk-test")
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)
    try:
        expected = tokenizer.decode(tokenizer.encode(REPLY))
        reply = await api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20)
        assert reply.choices[0].message.content == expected
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage is not None and reply.usage.completion_tokens == len(
            tokenizer.encode(REPLY)
        )

        stream = await api.chat.completions.create(
            model="tiny",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=1,
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
        assert "".join(pieces) == expected and usage is not None

        stream = await api.completions.create(
            model="tiny", prompt="the capital of", max_tokens=5, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream])
        assert text == tokenizer.decode(tokenizer.encode(REPLY)[:5])

        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="nope", prompt="x")
    finally:
        await api.close()
