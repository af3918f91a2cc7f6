"""The Responses API, served model aliases and /tokenizer_info on a running `pagedserve serve`."""

from __future__ import annotations

import json
import urllib.request
from typing import Literal

import jsonschema
import openai
import pytest

from services.bench.random_models import make_tiny_llama
from tests.service.stack_process import API_KEY, HEADERS, ServeProcess

agents = pytest.importorskip("agents")

ALIASES = ("gpt-tiny", "tiny-alias")
SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["small", "large"]}},
    "required": ["size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # A longer context than the shared tiny model's: an agent's tool schema takes ~600 tokens.
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-2k"), max_positions=2048)
    serve = ServeProcess(
        model_dir, "--served-model-name", *ALIASES,
        "--num-device-blocks", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
    )  # fmt: skip
    try:
        yield serve.url
    finally:
        assert serve.stop() == 0


@pytest.fixture
async def api(url):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    yield client
    await client.close()


def _get(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=HEADERS)) as response:
        return json.load(response)


def test_aliases_and_tokenizer_info(url) -> None:
    assert [card["id"] for card in _get(f"{url}/v1/models")["data"]] == list(ALIASES)
    info = _get(f"{url}/tokenizer_info")
    assert info["tokenizer_class"] and info["model_max_length"] == 2048
    assert "chat_template" in info


async def test_any_alias_is_served_and_only_they(api) -> None:
    for name in ALIASES:
        reply = await api.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == name
    with pytest.raises(openai.NotFoundError):
        await api.chat.completions.create(
            model="tiny-2k", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


async def test_a_response_is_the_chat_completion_of_its_input(api) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the capital of france"},
    ]
    chat = await api.chat.completions.create(
        model="gpt-tiny", messages=messages, max_tokens=12, temperature=0
    )
    response = await api.responses.create(
        model="gpt-tiny",
        instructions="be brief",
        input="the capital of france",
        max_output_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )

    stream = await api.responses.create(
        model="gpt-tiny",
        instructions="be brief",
        input="the capital of france",
        max_output_tokens=12,
        temperature=0,
        stream=True,
    )
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == response.output_text == events[-1].response.output_text


async def test_text_format_json_schema_is_enforced(api) -> None:
    for seed in range(3):
        response = await api.responses.create(
            model="gpt-tiny",
            input="small or large?",
            max_output_tokens=64,
            temperature=1.0,
            extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "size", "schema": SCHEMA}},
        )
        jsonschema.validate(json.loads(response.output_text), SCHEMA)


async def test_agent_with_a_function_tool_calls_it(api) -> None:
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["paris", "london"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    # The random model would rarely choose a call itself, nor end a reply before its token
    # limit (which the agent takes as a failed turn): the turn requires a call, the grammar makes
    # it valid, and the tool's result is the agent's answer. The full loop, model answer after
    # the tool, runs against scripted replies in tests/unit/gateway/test_responses_agent.py.
    settings = agents.ModelSettings(tool_choice="required", max_tokens=96, temperature=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    config = agents.RunConfig(
        model="gpt-tiny",
        model_provider=agents.OpenAIProvider(openai_client=api),
        tracing_disabled=True,
    )
    result = await agents.Runner.run(agent, "weather in paris?", run_config=config)
    assert len(cities) == 1 and cities[0] in ("paris", "london")
    assert result.final_output == "sunny"
