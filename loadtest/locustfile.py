"""Locust users that stream chat and completions from pagedserve and time every token.

Prompt and output lengths follow ShareGPT's shape (log-normal, means of about 161 and 338
tokens, the workload of the PagedAttention paper); LOADTEST_LENGTH_SCALE shrinks both for small
models. Time to first token and time per output token are reported as their own rows (types
TTFT and TPOT, in milliseconds). A request fails on a non-200 answer, a line that is not a JSON
event, an error event, or a stream that ends without `data: [DONE]`.

Environment: PAGEDSERVE_API_KEY, LOADTEST_LENGTH_SCALE (1.0), LOADTEST_MAX_PROMPT_TOKENS (1024),
LOADTEST_MAX_OUTPUT_TOKENS (512), LOADTEST_SEED.
"""

from __future__ import annotations

import json
import math
import os
import random
import time

from locust import HttpUser, between, events, task

SCALE = float(os.environ.get("LOADTEST_LENGTH_SCALE", "1.0"))
MAX_PROMPT_TOKENS = int(os.environ.get("LOADTEST_MAX_PROMPT_TOKENS", "1024"))
MAX_OUTPUT_TOKENS = int(os.environ.get("LOADTEST_MAX_OUTPUT_TOKENS", "512"))
# Log-normal (mu, sigma) with ShareGPT's means: exp(mu + sigma^2 / 2) = 161 and 338 tokens.
PROMPT_LOGNORMAL = (math.log(161) - 0.5, 1.0)
OUTPUT_LOGNORMAL = (math.log(338) - 0.32, 0.8)
WORDS = (
    "the memory of a model is paged into blocks that the scheduler shares between requests "
    "so that many users can stream their answers at once while the cache stays full"
).split()

_rng = random.Random(int(os.environ["LOADTEST_SEED"]) if "LOADTEST_SEED" in os.environ else None)


def sample_length(mu_sigma: tuple[float, float], cap: int) -> int:
    mu, sigma = mu_sigma
    return max(1, min(cap, round(_rng.lognormvariate(mu, sigma) * SCALE)))


def make_prompt(num_words: int) -> str:
    return " ".join(_rng.choice(WORDS) for _ in range(num_words))


class StreamError(Exception):
    """The stream broke the protocol; the message says how."""


class StreamingUser(HttpUser):
    wait_time = between(0.05, 0.5)

    def on_start(self) -> None:
        key = os.environ.get("PAGEDSERVE_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"
        with self.client.get("/v1/models", catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"/v1/models answered {response.status_code}")
                self.model = None
                return
            self.model = response.json()["data"][0]["id"]

    @task(1)
    def chat(self) -> None:
        body = {"messages": [{"role": "user", "content": self._prompt()}]}
        self._stream(
            "/v1/chat/completions", "chat", body, lambda c: c.get("delta", {}).get("content")
        )

    @task(1)
    def completion(self) -> None:
        self._stream(
            "/v1/completions", "completion", {"prompt": self._prompt()}, lambda c: c.get("text")
        )

    def _prompt(self) -> str:
        return make_prompt(sample_length(PROMPT_LOGNORMAL, MAX_PROMPT_TOKENS))

    def _stream(self, path: str, name: str, body: dict, content_of) -> None:
        if self.model is None:
            return
        max_tokens = sample_length(OUTPUT_LOGNORMAL, MAX_OUTPUT_TOKENS)
        body = {
            **body,
            "model": self.model,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # the sampled output length, not wherever the model stops
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = last = None
        usage = None
        with self.client.post(path, json=body, stream=True, catch_response=True, name=name) as r:
            try:
                if r.status_code != 200:
                    raise StreamError(f"HTTP {r.status_code}: {r.text[:200]}")
                done = False
                for raw in r.iter_lines():
                    if not raw:
                        continue
                    line = raw.decode()
                    if not line.startswith("data: "):
                        raise StreamError(f"not an SSE data line: {line[:100]!r}")
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise StreamError(f"malformed JSON event: {data[:100]!r}") from None
                    if "error" in event:
                        raise StreamError(f"error event: {event['error'].get('message')}")
                    usage = event.get("usage") or usage
                    if any(content_of(c) for c in event.get("choices", [])):
                        last = time.perf_counter()
                        first = first or last
                if not done:
                    raise StreamError("the stream ended without data: [DONE]")
                if first is None:
                    raise StreamError("no token arrived")
            except StreamError as exc:
                r.failure(str(exc))
                return
            r.success()
        num_tokens = usage["completion_tokens"] if usage else None
        _report("TTFT", name, (first - start) * 1000)
        if num_tokens and num_tokens > 1:
            _report("TPOT", name, (last - first) * 1000 / (num_tokens - 1))


def _report(kind: str, name: str, milliseconds: float) -> None:
    events.request.fire(
        request_type=kind,
        name=name,
        response_time=milliseconds,
        response_length=0,
        exception=None,
        context={},
    )
