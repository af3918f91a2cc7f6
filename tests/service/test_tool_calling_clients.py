"""Tool calling through real clients (openai, langchain-openai) against `pagedserve serve`."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from services.bench.random_models import make_tiny_llama
from tests.service.stack_process import API_KEY, ServeProcess

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "weather in paris"}]
NUM_REQUESTS = 100  # seeded sampled requests per forced choice, half of them streamed


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A served tiny model with room for tool definitions in its prompt: its tokenizer spells
    JSON nearly a character a token, and the shared fixture's model holds 512."""
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"), max_positions=2048)
    serve = ServeProcess(model_dir, "--num-device-blocks", "512", "--max-num-seqs", "8")
    try:
        yield serve.url, serve.model, None
    finally:
        assert serve.stop() == 0


class Weather(BaseModel):
    """Weather of a city."""

    city: str = Field(pattern="^[a-z]{1,8}$")
    days: int = Field(ge=0, le=9)


def _client(stack) -> openai.AsyncOpenAI:
    url, _, _ = stack
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


async def _calls(client, model: str, index: int, **kwargs) -> list[dict]:
    """One seeded sampled request's tool calls as plain dicts; streamed for odd indices."""
    common = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=index)
    if index % 2 == 0:
        reply = await client.chat.completions.create(**common, **kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        return [c.model_dump() for c in choice.message.tool_calls]
    calls: dict[int, dict] = {}
    stream = await client.chat.completions.create(stream=True, **common, **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"function": {"name": "", "arguments": ""}})
                if d.id:
                    call["id"], call["type"] = d.id, d.type
                if d.function and d.function.name:
                    call["function"]["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["function"]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)]


def _invalid(calls: list[dict], names: set[str]) -> list[dict]:
    bad = []
    for call in calls:
        fn = call["function"]
        try:
            assert call["id"].startswith("call_") and fn["name"] in names
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
        except (AssertionError, ValueError, jsonschema.ValidationError):
            bad.append(call)
    return bad


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ("required", {"get_weather", "get_time"}),
    ],
)
async def test_forced_tool_choices_always_give_valid_calls(stack, tool_choice, names):
    _, model, _ = stack
    client = _client(stack)
    try:
        results = await asyncio.gather(
            # One call per reply: with parallel calls allowed a random model may chain calls
            # until max_tokens, and a reply cut short is (rightly) no call at all.
            *(
                _calls(client, model, i, tool_choice=tool_choice, parallel_tool_calls=False)
                for i in range(NUM_REQUESTS)
            )
        )
    finally:
        await client.close()
    assert all(results), "every forced reply makes at least one call"
    assert _invalid([c for calls in results for c in calls], names) == []


async def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(stack):
    _, model, _ = stack
    client = _client(stack)
    named = {"type": "function", "function": {"name": "get_weather"}}
    try:
        # Greedy: the streamed and the whole reply are the same tokens.
        whole = await _calls(client, model, 0, tool_choice=named, temperature=0)
        streamed = await _calls(client, model, 1, tool_choice=named, temperature=0)
    finally:
        await client.close()
    assert [c["function"] for c in streamed] == [c["function"] for c in whole]


async def test_auto_choice_never_fails_and_answers_calls_or_content(stack):
    _, model, _ = stack
    client = _client(stack)
    try:
        for seed in range(4):
            reply = await client.chat.completions.create(
                model=model, messages=MESSAGES, tools=TOOLS, max_tokens=40, seed=seed
            )
            message = reply.choices[0].message
            assert message.tool_calls or message.content is not None
    finally:
        await client.close()


def _chat_model(stack, **kwargs):
    from langchain_openai import ChatOpenAI

    url, model, _ = stack
    return ChatOpenAI(
        model=model, base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, max_tokens=200, **kwargs
    )


def test_langchain_bind_tools_gets_parsed_calls(stack):
    llm = _chat_model(stack, temperature=0).bind_tools(TOOLS, tool_choice="get_weather")
    message = llm.invoke("weather in paris")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], PARAMS)
    # The streamed chunks merge (by tool-call index) into the same call.
    merged = None
    for chunk in llm.stream("weather in paris"):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]


def test_langchain_structured_output_by_function_calling(stack):
    llm = _chat_model(stack).with_structured_output(Weather, method="function_calling")
    for seed in range(6):
        result = llm.bind(seed=seed).invoke("weather in paris")
        assert isinstance(result, Weather) and 0 <= result.days <= 9


@pytest.mark.parametrize("mode_name", ["TOOLS", "JSON_SCHEMA"])
async def test_instructor_response_models_validate(stack, mode_name):
    """instructor's forced tool call (TOOLS) and its response_format (JSON_SCHEMA) both come back
    as a validated pydantic object, on every seed: the grammar holds the tiny model to the schema,
    so instructor never needs a retry (max_retries=0 would raise on the first invalid reply)."""
    import instructor

    client = instructor.from_openai(_client(stack), mode=getattr(instructor.Mode, mode_name))
    _, model, _ = stack
    try:
        for seed in range(4):
            result = await client.chat.completions.create(
                model=model,
                response_model=Weather,
                messages=MESSAGES,
                max_tokens=200,
                seed=seed,
                max_retries=0,
            )
            assert isinstance(result, Weather) and 0 <= result.days <= 9, result
    finally:
        await client.client.close()


async def test_instructor_partial_stream_ends_in_the_whole_object(stack):
    """instructor's create_partial streams growing partial objects from tool-call deltas (its
    Partial model makes every field optional, so its schema and thus its tokens differ from the
    plain request's); the last one is a whole valid object, the first ones lack fields."""
    import instructor

    client = instructor.from_openai(_client(stack), mode=instructor.Mode.TOOLS)
    _, model, _ = stack
    try:
        partials = [
            p.model_dump()
            async for p in client.chat.completions.create_partial(
                model=model,
                response_model=Weather,
                messages=MESSAGES,
                max_tokens=200,
                temperature=0,
                max_retries=0,
            )
        ]
    finally:
        await client.client.close()
    assert len(partials) > 1, "several partial objects arrive before the last"
    assert None in partials[0].values(), partials[0]
    assert Weather.model_validate(partials[-1]).model_dump() == partials[-1]
