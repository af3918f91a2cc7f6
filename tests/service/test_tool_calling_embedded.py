"""Tool calling through the openai client and langchain-openai against the embedded model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest

from shared.model_source import EMBEDDED_MODEL
from tests.service.stack_process import API_KEY, ServeProcess

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": PARAMS,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
NUM_REQUESTS = 8  # seeded sampled requests, half streamed


@pytest.fixture(scope="module")
def stack():
    serve = ServeProcess(Path(EMBEDDED_MODEL), "--kv-cache-gb", "0.2", "--swap-space-gb", "0.1")
    try:
        yield serve.url, serve.model
    finally:
        assert serve.stop() == 0


async def _arguments(client, model: str, seed: int, choice) -> tuple[str, str]:
    common = dict(
        model=model, messages=QUESTION, tools=[WEATHER], tool_choice=choice, max_tokens=60,
        parallel_tool_calls=False,
        seed=seed,
    )  # fmt: skip
    if seed % 2 == 0:
        [call] = (await client.chat.completions.create(**common)).choices[0].message.tool_calls
        return call.function.name, call.function.arguments
    name, args = "", ""
    async for chunk in await client.chat.completions.create(stream=True, **common):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = name or (d.function.name or "")
            args += d.function.arguments or ""
    return name, args


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_forced_calls_of_the_embedded_model_validate(stack, choice):
    url, model = stack
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    try:
        calls = await asyncio.gather(
            *(_arguments(client, model, seed, choice) for seed in range(NUM_REQUESTS))
        )
    finally:
        await client.close()
    for name, args in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(args), PARAMS)


def test_langchain_bind_tools_on_the_embedded_model(stack):
    from langchain_openai import ChatOpenAI

    url, model = stack
    llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key=API_KEY, max_tokens=60)
    forced = llm.bind_tools([WEATHER], tool_choice="any", parallel_tool_calls=False)
    message = forced.invoke(QUESTION[0]["content"])
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], PARAMS)
    # auto: whatever the model writes comes back as calls or as content, never an error.
    reply = llm.bind_tools([WEATHER]).invoke(QUESTION[0]["content"])
    assert reply.tool_calls or reply.content
    structured = llm.with_structured_output(WEATHER["function"], method="function_calling")
    jsonschema.validate(structured.invoke(QUESTION[0]["content"]), PARAMS)


async def test_instructor_tools_mode_on_the_embedded_model(stack):
    import instructor
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(pattern="^[A-Za-z ]{1,20}$")
        unit: Literal["celsius", "fahrenheit"]

    url, model = stack
    raw = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    try:
        for seed in range(2):
            result = await client.chat.completions.create(
                model=model,
                response_model=Weather,
                messages=QUESTION,
                max_tokens=60,
                seed=seed,
                max_retries=0,
            )
            assert isinstance(result, Weather), result
    finally:
        await raw.close()


async def test_agent_calls_its_tool_then_answers_on_the_embedded_model(stack):
    """The whole agent loop on openai-agents' default (Responses) model: the first turn must call
    the tool, the agent runs it and asks again (tool choice back to auto), and the model's second
    reply is the final answer."""
    agents = pytest.importorskip("agents")
    url, model = stack
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees in {city}."

    raw = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer the user's question in one sentence.",
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=256, temperature=0
        ),
    )
    config = agents.RunConfig(
        model=model,
        model_provider=agents.OpenAIProvider(openai_client=raw),
        tracing_disabled=True,
    )
    try:
        result = await agents.Runner.run(agent, QUESTION[0]["content"], run_config=config)
    finally:
        await raw.close()
    assert len(cities) >= 1, "the agent ran its tool"
    kinds = [item.type for item in result.new_items]
    assert kinds.index("tool_call_item") < kinds.index("tool_call_output_item")
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
