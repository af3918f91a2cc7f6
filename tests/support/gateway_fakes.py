"""A scripted stand-in for the gateway's backend, and the request bodies and SSE parsing that
tests of the HTTP API share."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp.test_utils import TestClient

from services.gateway.backend import BackendGone
from shared.protocol import (
    ExecutorReady,
    GenerateRequest,
    PromptLogprobs,
    RequestDelta,
    SampledToken,
    SchedulerReady,
    SchedulerStats,
    SeqDelta,
)

INFO = SchedulerReady(
    executor=ExecutorReady(
        num_device_blocks=64,
        num_cpu_blocks=0,
        block_size=16,
        max_model_len=512,
        vocab_size=384,
        eos_token_ids=(2,),
    ),
    max_num_seqs=16,
    model_name="tiny",
)
REPLY = " the capital of france is paris"
CHAT = [{"role": "user", "content": "what is the capital of france"}]


class FakeBackend:
    """Replies with fixed token sequences (sample i gets replies[i % len]), one per step."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.replies = [tokenizer.encode(REPLY)]
        self.is_ready = True
        self.delay = 0.002  # seconds before each delta
        self.reject: dict[str, Any] | None = None  # answer with this error and finish
        self.gone_after: int | None = None  # raise BackendGone before this delta
        self.fail_after: int | None = None  # end every sample with "error" at this delta
        self.crash: Exception | None = None  # raise this from generate()
        self.hold_first = False  # never send the first delta (a request stuck in the queue)
        self.current_stats = SchedulerStats(
            num_running=2,
            num_waiting=0,
            num_swapped=0,
            kv_blocks_used=16,
            kv_blocks_total=64,
            num_preemptions=3,
            num_steps=10,
        )
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []

    @property
    def ready(self) -> bool:
        return self.is_ready

    @property
    def info(self) -> SchedulerReady | None:
        return INFO

    @property
    def stats(self) -> SchedulerStats | None:
        return self.current_stats

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        self.requests.append(request)
        rid, sp = request.request_id, request.sampling
        if self.crash is not None:
            raise self.crash
        if self.reject is not None:
            yield RequestDelta(rid, [], finished=True, error=self.reject)
            return
        if self.hold_first:
            await asyncio.sleep(3600)
        replies = [self.replies[i % len(self.replies)][: sp.max_tokens] for i in range(sp.n)]
        steps = max(len(r) for r in replies)
        for step in range(steps):
            await asyncio.sleep(self.delay)
            if self.gone_after is not None and step >= self.gone_after:
                raise BackendGone("the scheduler died")
            if self.fail_after is not None and step >= self.fail_after:
                seqs = [SeqDelta(i, [], finish_reason="error") for i in range(sp.n)]
                yield RequestDelta(rid, seqs, True)
                return
            seqs = []
            for i, reply in enumerate(replies):
                if step >= len(reply):
                    continue
                reason = None
                if step == len(reply) - 1:
                    reason = "length" if len(reply) == sp.max_tokens else "stop"
                token = reply[step]
                logprobs = []
                if sp.logprobs is not None:
                    top = [(token, -0.5), (7, -1.5), (8, -2.5)][: sp.logprobs]
                    logprobs = [SampledToken(i, token, -0.5, top)]
                seqs.append(SeqDelta(i, [token], logprobs, reason))
            prompt_len = len(request.prompt_token_ids)
            delta = RequestDelta(rid, seqs, step == steps - 1, num_prompt_tokens=prompt_len)
            if step == 0 and sp.prompt_logprobs is not None:  # every prompt token at -1.0
                delta.prompt_logprobs = _prompt_logprobs(request.prompt_token_ids)
            yield delta

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _prompt_logprobs(prompt_ids: list[int]) -> PromptLogprobs:
    tokens = [SampledToken(0, t, -1.0, [(t, -1.0)]) for t in prompt_ids[1:]]
    return PromptLogprobs(0, 1, tokens, [1] * len(tokens))


def parse_sse(text: str) -> list[Any]:
    """Events of a complete SSE body; asserts the framing and the closing [DONE]."""
    assert text.endswith("data: [DONE]\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events.count("[DONE]") == 1
    return events[:-1]


async def post_sse(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(path, json=body | {"stream": True})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(await resp.text())


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "the capital of", "max_tokens": 5} | extra


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT} | extra
