"""POST /v1/responses over the fake backend: input translation, the response object, the stream."""

from __future__ import annotations

import json

import pytest

from services.gateway.responses_request import chat_body
from shared.errors import InvalidRequestError
from tests.support.gateway_fakes import REPLY

openai = pytest.importorskip("openai")


def _events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_input_items_become_chat_messages() -> None:
    body = {
        "model": "tiny",
        "instructions": "be brief",
        "input": [
            {"role": "developer", "content": "use tools"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        ],
        "max_output_tokens": 7,
        "temperature": 0.5,
        "seed": 3,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "store": False,
        "include": [],
        "metadata": {"k": "v"},
    }
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "use tools"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    assert chat["max_completion_tokens"] == 7 and chat["temperature"] == 0.5 and chat["seed"] == 3
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat_body({"model": "tiny", "input": "hello"})["messages"] == [
        {"role": "user", "content": "hello"}
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(extra, param) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat_body({"model": "tiny", "input": "hi"} | extra)
    assert caught.value.param == param


async def test_response_object(serve, tokenizer) -> None:
    client, backend = await serve()
    resp = await client.post(
        "/v1/responses",
        json={
            "model": "tiny",
            "input": "what is the capital of france",
            "instructions": "be brief",
        },
    )
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    expected = tokenizer.decode(tokenizer.encode(REPLY))
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["model"] == "tiny"
    assert body["instructions"] == "be brief" and body["store"] is False
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"] == [
        {"type": "output_text", "text": expected, "annotations": [], "logprobs": []}
    ]
    [request] = backend.requests
    assert body["usage"]["input_tokens"] == len(request.prompt_token_ids)
    assert body["usage"]["output_tokens"] == len(tokenizer.encode(REPLY))
    assert body["usage"]["total_tokens"] == sum(
        body["usage"][k] for k in ("input_tokens", "output_tokens")
    )


async def test_max_output_tokens_makes_an_incomplete_response(serve) -> None:
    client, backend = await serve()
    resp = await client.post(
        "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3}
    )
    body = await resp.json()
    assert backend.requests[0].sampling.max_tokens == 3
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3


async def test_errors_name_the_responses_field(serve) -> None:
    client, _ = await serve()
    cases = [
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "nobody", "content": "x"}]}, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": 3}}}, "text"),
        ({"input": "hi", "store": True}, "store"),
    ]
    for extra, param in cases:
        resp = await client.post("/v1/responses", json={"model": "tiny"} | extra)
        assert resp.status == 400, extra
        error = (await resp.json())["error"]
        assert error["param"] == param, error
        assert "max_completion_tokens" not in error["message"]
    resp = await client.post("/v1/responses", json={"model": "other", "input": "hi"})
    assert resp.status == 404


async def test_stream_event_sequence(serve, tokenizer) -> None:
    client, _ = await serve()
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": "hi", "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = _events(await resp.text())
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = names.count("response.output_text.delta")
    assert deltas >= 2
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    expected = tokenizer.decode(tokenizer.encode(REPLY))
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == expected
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == expected
    assert final["id"] == events[0][1]["response"]["id"]
    assert final["usage"]["output_tokens"] == len(tokenizer.encode(REPLY))


async def test_a_rejected_stream_gets_its_status_code(serve) -> None:
    client, backend = await serve()
    backend.reject = {"message": "no", "type": "invalid_request_error", "param": None, "code": None}
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": "hi", "stream": True})
    assert resp.status == 400 and (await resp.json())["error"]["message"] == "no"


async def test_a_stream_failing_midway_ends_with_response_failed(serve) -> None:
    client, backend = await serve()
    backend.fail_after = 2
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": "hi", "stream": True})
    events = _events(await resp.text())
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"]["message"]


async def test_openai_client(serve, tokenizer) -> None:
    client, _ = await serve(api_key="sk-test")
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)
    expected = tokenizer.decode(tokenizer.encode(REPLY))
    try:
        response = await api.responses.create(model="tiny", input="hi", instructions="be brief")
        assert response.output_text == expected and response.status == "completed"
        stream = await api.responses.create(model="tiny", input="hi", stream=True)
        events = [event async for event in stream]
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == expected
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == expected
        with pytest.raises(openai.BadRequestError):
            await api.responses.create(model="tiny", input="hi", previous_response_id="resp_x")
    finally:
        await api.close()


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


async def _tool_reply(serve, tokenizer, text: str, **fields) -> tuple[dict, list]:
    client, backend = await serve()
    backend.replies = [tokenizer.encode(text)]
    body = {"model": "tiny", "input": "weather in paris?", "tools": [WEATHER], **fields}
    whole = await (await client.post("/v1/responses", json=body)).json()
    resp = await client.post("/v1/responses", json=body | {"stream": True})
    return whole, _events(await resp.text())


async def test_function_calls_become_function_call_items(serve, tokenizer) -> None:
    whole, events = await _tool_reply(
        serve, tokenizer, f"Checking.<tool_call>{json.dumps(CALL)}</tool_call>"
    )
    assert whole["status"] == "completed"
    message, call = whole["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Checking."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert json.loads(call["arguments"]) == CALL["arguments"]

    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in names
    arguments = "".join(
        d["delta"] for n, d in events if n == "response.function_call_arguments.delta"
    )
    [done] = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert json.loads(arguments) == CALL["arguments"] == json.loads(done["arguments"])
    final = events[-1][1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"]
    assert final[1]["name"] == "get_weather" and final[1]["status"] == "completed"


async def test_a_named_tool_choice_forces_the_call(serve, tokenizer) -> None:
    choice = {"type": "function", "name": "get_weather"}
    whole, _ = await _tool_reply(
        serve, tokenizer, json.dumps(CALL["arguments"]), tool_choice=choice
    )
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == CALL["arguments"]


async def test_openai_client_tool_round_trip(serve, tokenizer) -> None:
    client, backend = await serve(api_key="sk-test")
    backend.replies = [tokenizer.encode(f"<tool_call>{json.dumps(CALL)}</tool_call>")]
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-test", max_retries=0)
    try:
        first = await api.responses.create(model="tiny", input="weather?", tools=[WEATHER])
        [call] = first.output
        assert call.type == "function_call" and call.name == "get_weather"
        backend.replies = [tokenizer.encode(" sunny")]
        history = [
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ]
        second = await api.responses.create(model="tiny", input=history, tools=[WEATHER])
        assert second.output_text == " sunny"
        prompt = tokenizer.decode(backend.requests[-1].prompt_token_ids)
        assert "sunny, 21 C" in prompt and "get_weather" in prompt
    finally:
        await api.close()
