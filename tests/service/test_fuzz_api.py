"""Property-based fuzzing of a real `pagedserve serve` from its own /openapi.json: 1,000 generated
bodies per POST endpoint (valid by the schema, one field broken, or any JSON at all) get no 5xx,
and every 4xx carries an OpenAI-style error body."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.schema_strategy import ANY_JSON, from_schema
from tests.service.stack_process import HEADERS, ServeProcess

NUM_BODIES = 1000  # per endpoint
BATCH = 50  # bodies sent together
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/detokenize"]
CAPPED = ("max_tokens", "max_completion_tokens", "min_tokens")  # keep generation cheap


@pytest.fixture(scope="module")
def serve(tiny_model_dir):
    stack = ServeProcess(
        tiny_model_dir, "--num-device-blocks", "256", "--max-num-seqs", "64",
        "--request-timeout", "60",
    )  # fmt: skip
    yield stack
    assert stack.stop() == 0


def _schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def _bodies(schema: dict, model: str) -> st.SearchStrategy:
    def fix(body, use_model: bool):
        if isinstance(body, dict):
            if use_model and "model" in body:
                body["model"] = model
            for key in CAPPED:
                if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                    body[key] = min(body[key], 4)
            if not any(key in body for key in CAPPED):
                body["max_tokens"] = 4  # chat's default is the whole remaining context
        return body

    valid = from_schema(schema)
    broken = st.tuples(valid, st.text(max_size=20), ANY_JSON).map(
        lambda t: {**t[0], (t[1] if t[1] or not t[0] else next(iter(t[0]))): t[2]}
    )
    anything = ANY_JSON
    one = st.one_of(valid, valid, broken, anything)
    return st.tuples(one, st.booleans()).map(lambda t: fix(t[0], t[1]))


async def _post_all(url: str, bodies: list) -> list[tuple[int, dict | None, str]]:
    async def post(session, body):
        data = json.dumps(body)
        async with session.post(
            url, data=data, headers=HEADERS | {"Content-Type": "application/json"}
        ) as r:
            text = await r.text()
            return r.status, r.headers.get("Content-Type", ""), text

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(post(session, b) for b in bodies))


def _check(status: int, content_type: str, text: str, body) -> str:
    assert status < 500, (status, body, text[:300])
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], text
        assert isinstance(error["type"], str) and "param" in error and "code" in error, text
    elif content_type.startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), text[-200:]
        for block in text.split("\n\n")[:-2]:
            event = json.loads(block[len("data: ") :])
            if "error" in event:  # a failure after the headers went out: no 5xx in disguise
                assert event["error"]["type"] != "internal_error", (body, event)
    return f"{status}"


@pytest.mark.parametrize("path", ENDPOINTS)
def test_generated_bodies_get_no_5xx_and_openai_errors(serve, path):
    request = urllib.request.Request(f"{serve.url}/openapi.json", headers=HEADERS)
    with urllib.request.urlopen(request) as response:
        spec = json.loads(response.read())
    # Generate first, then send in concurrent batches: the server sees bursts of mixed bodies and
    # the test's time goes to requests, not to one round trip per generated example.
    bodies: list = []

    @settings(
        max_examples=NUM_BODIES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_bodies(_schema(spec, path), serve.model))
    def collect(body):
        bodies.append(body)

    collect()
    tally: Counter[str] = Counter()
    for start in range(0, len(bodies), BATCH):
        batch = bodies[start : start + BATCH]
        for body, (status, content_type, text) in zip(
            batch, asyncio.run(_post_all(serve.url + path, batch))
        ):
            tally[_check(status, content_type, text, body)] += 1
    print(f"{path}: {sum(tally.values())} bodies, statuses {dict(sorted(tally.items()))}")
    assert sum(tally.values()) == NUM_BODIES
    assert not [s for s in tally if s.startswith("5")]


def test_model_paths_get_no_5xx(serve):
    @settings(max_examples=200, derandomize=True, deadline=None, database=None)
    @given(st.text(min_size=1, max_size=60))
    def run(name):
        quoted = urllib.parse.quote(name, safe="")
        request = urllib.request.Request(f"{serve.url}/v1/models/{quoted}", headers=HEADERS)
        try:
            with urllib.request.urlopen(request) as response:
                assert response.status == 200
        except urllib.error.HTTPError as exc:
            assert exc.code < 500
            assert json.loads(exc.read())["error"]["message"]

    run()
