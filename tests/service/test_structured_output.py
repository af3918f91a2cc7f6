"""Structured output, best_of and penalties through `pagedserve serve` and the `openai` client."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.service.stack_process import API_KEY

ENUM_SCHEMA = {"enum": ["paris", "london", "berlin", "madrid"]}
OBJECT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
    },
    "required": ["city", "population", "capital", "size"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2,4}"
NUM_REQUESTS = 100  # per constraint; half streamed, half not


async def _text(client, model: str, index: int, **kwargs) -> str:
    """One seeded sampled chat request; streamed for odd indices."""
    common = dict(
        model=model,
        messages=[{"role": "user", "content": "name a city"}],
        max_tokens=150,
        temperature=1.0,
        seed=index,
    )
    if index % 2:
        stream = await client.chat.completions.create(stream=True, **common, **kwargs)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    reply = await client.chat.completions.create(**common, **kwargs)
    return reply.choices[0].message.content


async def _run_all(stack, **kwargs) -> list[str]:
    url, model, _ = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    try:
        return await asyncio.gather(
            *(_text(client, model, i, **kwargs) for i in range(NUM_REQUESTS))
        )
    finally:
        await client.close()


def _invalid(texts: list[str], schema: dict) -> list[str]:
    bad = []
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            bad.append(text)
    return bad


async def test_json_schema_with_an_enum_always_validates(stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": ENUM_SCHEMA}}
    texts = await _run_all(stack, response_format=fmt)
    assert _invalid(texts, ENUM_SCHEMA) == []
    assert len(set(texts)) > 1  # sampled, not one fixed answer


async def test_json_schema_object_with_typed_fields_always_validates(stack):
    texts = await _run_all(stack, extra_body={"guided_json": OBJECT_SCHEMA})
    assert _invalid(texts, OBJECT_SCHEMA) == []
    assert len(set(texts)) > 50


async def test_guided_regex_always_matches(stack):
    texts = await _run_all(stack, extra_body={"guided_regex": REGEX})
    assert [t for t in texts if not re.fullmatch(REGEX, t)] == []
    assert len(set(texts)) > 50


async def test_json_object_mode_and_unconstrained_requests_share_batches(stack):
    url, model, _ = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    json_mode = [_text(client, model, i, response_format={"type": "json_object"}) for i in range(8)]
    free = [_text(client, model, i) for i in range(8)]
    texts = await asyncio.gather(*json_mode, *free)
    await client.close()
    for text in texts[:8]:
        # strict=False: xgrammar's JSON strings admit raw control characters (not \r or \n)
        # that strict parsers refuse; free-form strings from a random model contain some.
        assert isinstance(json.loads(text, strict=False), dict), text


async def test_best_of_and_its_streaming_refusal_through_the_client(stack):
    url, model, _ = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    reply = await client.completions.create(
        model=model, prompt="the capital", max_tokens=6, n=2, best_of=4, seed=3, logprobs=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    totals = [sum(c.logprobs.token_logprobs) for c in reply.choices]
    assert totals[0] >= totals[1]  # best first
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            model=model, prompt="the capital", max_tokens=6, best_of=3, stream=True
        )
    assert info.value.body["param"] == "best_of"
    await client.close()
