"""An openai-agents agent on its default (Responses) model calls a function tool, then answers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.support.gateway_fakes import INFO, FakeBackend

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ANSWER = " It is sunny in Paris."


@pytest.fixture
def long_context(monkeypatch):
    """Room for the agent's tool schema, which the tiny tokenizer spells in many tokens."""
    executor = dataclasses.replace(INFO.executor, max_model_len=4096, num_device_blocks=512)
    info = dataclasses.replace(INFO, executor=executor)
    monkeypatch.setattr(FakeBackend, "info", property(lambda self: info))


@pytest.mark.parametrize("stream", [False, True])
async def test_agent_calls_the_tool_and_answers(serve, tokenizer, long_context, stream) -> None:
    client, backend = await serve(api_key="sk-test")
    # The fake model replies with a call until the tool has run, then with the answer.
    backend.replies = [tokenizer.encode(f"<tool_call>{json.dumps(CALL)}</tool_call>")]
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        backend.replies = [tokenizer.encode(ANSWER)]
        return "sunny, 21 C"

    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather])
    config = agents.RunConfig(
        model="tiny",
        model_provider=agents.OpenAIProvider(openai_client=api),  # Responses API by default
        tracing_disabled=True,
    )
    try:
        if stream:
            result = agents.Runner.run_streamed(agent, "weather in paris?", run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "weather in paris?", run_config=config)
    finally:
        await api.close()
    assert cities == ["Paris"]
    assert result.final_output == tokenizer.decode(tokenizer.encode(ANSWER))
    # The second model call saw the call and its result in its prompt.
    prompt = tokenizer.decode(backend.requests[-1].prompt_token_ids)
    assert "sunny, 21 C" in prompt
    assert len(backend.requests) == 2  # one model call for the tool, one for the answer
