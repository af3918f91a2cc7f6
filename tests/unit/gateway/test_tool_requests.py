"""Tool calling on /v1/chat/completions: request fields, prompt rendering, replies and deltas."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from services.gateway.openai_api import parse_chat_request
from shared.errors import InvalidRequestError
from tests.support.gateway_fakes import CHAT, INFO, chat, post_sse

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
HERMES_REPLY = f"I will check.<tool_call>\n{json.dumps(CALL)}\n</tool_call>"


def _chat(tokenizer, **fields: Any):
    body = {"model": "tiny", "messages": CHAT, **fields}
    return parse_chat_request(body, INFO, tokenizer)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),  # a name twice
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),  # noqa: E501
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["x"]}}},
            "tool_choice",
        ),  # noqa: E501
        ({"tools": TOOLS, "tool_choice": ["auto"]}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(tokenizer, fields, param):
    with pytest.raises(InvalidRequestError) as info:
        _chat(tokenizer, **fields)
    assert info.value.param == param, info.value.message


def test_a_template_without_tools_gets_them_in_a_fallback_system_prompt(tokenizer):
    plain = _chat(tokenizer).prompt_token_ids
    parsed = _chat(tokenizer, tools=TOOLS)
    text = tokenizer.decode(parsed.prompt_token_ids)
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text
    assert parsed.tools is not None and parsed.tools.choice == "auto"
    assert parsed.sampling.guided is None  # auto: the model chooses
    # tool_choice none: the tools are not offered, the prompt is the plain one.
    none = _chat(tokenizer, tools=TOOLS, tool_choice="none")
    assert none.tools is None and none.prompt_token_ids == plain


def test_a_template_with_a_tool_section_renders_tools_as_transformers_does(tokenizer):
    templated = copy.copy(tokenizer)
    templated.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
    )
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": "tiny", "messages": history, "tools": TOOLS}
    text = templated.decode(parse_chat_request(body, INFO, templated).prompt_token_ids)
    assert text.startswith("TOOLS:get_weather;get_time;")
    assert 'CALL get_weather {"city": "Paris"}' in text and "tool: sunny" in text


def test_history_with_calls_renders_in_the_fallback_format(tokenizer):
    history = [
        *CHAT,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "noon"},
    ]
    text = tokenizer.decode(_chat(tokenizer, messages=history, tools=TOOLS).prompt_token_ids)
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\nnoon\n</tool_response>" in text
    bad = [
        *CHAT,
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
    ]  # noqa: E501
    with pytest.raises(InvalidRequestError):
        _chat(tokenizer, messages=bad)


def test_required_and_named_choices_become_a_schema_over_the_call(tokenizer):
    named = _chat(tokenizer, tools=TOOLS, tool_choice=NAMED).sampling.guided
    assert named is not None and named[0] == "json_schema" and json.loads(named[1]) == PARAMS
    kind, spec = _chat(tokenizer, tools=TOOLS, tool_choice="required").sampling.guided
    schema = json.loads(spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"days": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    single = _chat(tokenizer, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.sampling.guided[1])["maxItems"] == 1


async def _reply(serve, tokenizer, text: str, **fields: Any) -> tuple[dict, list[dict]]:
    client, backend = await serve()
    backend.replies = [tokenizer.encode(text)]
    body = chat(tools=TOOLS, max_tokens=400, **fields)
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    whole = await resp.json()
    events = await post_sse(client, "/v1/chat/completions", {**body, "stream": True})
    return whole, [e for e in events if isinstance(e, dict)]


def _reassemble(events: list[dict]) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls", []):
                call = calls.setdefault(d["index"], {"function": {"arguments": ""}})
                if "id" in d:
                    call.update(id=d["id"], type=d["type"])
                    call["function"]["name"] = d["function"]["name"]
                call["function"]["arguments"] += d["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


async def test_auto_reply_with_a_call_is_parsed_and_streams_to_the_same_call(serve, tokenizer):
    whole, events = await _reply(serve, tokenizer, HERMES_REPLY)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I will check."
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]

    content, calls, finish = _reassemble(events)
    assert content == "I will check." and finish == "tool_calls"
    assert [c["function"] for c in calls] == [call["function"]]
    assert calls[0]["id"].startswith("call_")
    first_delta = next(e for e in events if "tool_calls" in e["choices"][0]["delta"])
    head = first_delta["choices"][0]["delta"]["tool_calls"][0]
    assert head["index"] == 0 and head["function"] == {"name": "get_weather", "arguments": ""}


async def test_several_calls_in_one_reply_stream_by_index(serve, tokenizer):
    second = {"name": "get_time", "arguments": {}}
    text = f"<tool_call>{json.dumps(CALL)}</tool_call><tool_call>{json.dumps(second)}</tool_call>"
    whole, events = await _reply(serve, tokenizer, text)
    message = whole["choices"][0]["message"]
    assert message["content"] is None
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert names == ["get_weather", "get_time"]
    _, calls, _ = _reassemble(events)
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]


async def test_without_parallel_calls_auto_mode_keeps_the_first_call(serve, tokenizer):
    second = {"name": "get_time", "arguments": {}}
    text = f"<tool_call>{json.dumps(CALL)}</tool_call><tool_call>{json.dumps(second)}</tool_call>"
    whole, events = await _reply(serve, tokenizer, text, parallel_tool_calls=False)
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert [c["function"] for c in _reassemble(events)[1]] == [call["function"]]


async def test_an_unparseable_call_in_auto_mode_is_plain_content(serve, tokenizer):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    whole, events = await _reply(serve, tokenizer, text)
    choice = whole["choices"][0]
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    content, calls, finish = _reassemble(events)
    assert content == text and calls == [] and finish == "stop"


async def test_named_and_required_replies_are_read_as_the_forced_json(serve, tokenizer):
    whole, events = await _reply(serve, tokenizer, json.dumps(CALL["arguments"]), tool_choice=NAMED)
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]
    assert [c["function"] for c in _reassemble(events)[1]] == [call["function"]]

    items = [{"name": "get_time", "parameters": {}}]
    whole, _ = await _reply(serve, tokenizer, json.dumps(items), tool_choice="required")
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}


async def test_plain_text_in_auto_mode_streams_as_content(serve, tokenizer):
    whole, events = await _reply(serve, tokenizer, " the capital of france is paris")
    assert whole["choices"][0]["message"]["content"] == " the capital of france is paris"
    content, calls, finish = _reassemble(events)
    assert content == " the capital of france is paris" and calls == [] and finish == "stop"
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content")) > 1


async def test_a_named_choice_streams_its_arguments_as_they_are_generated(serve, tokenizer):
    # A raw control character, as xgrammar's JSON strings admit: escaped alike in both.
    args = '{"city": "Par\x04is", "days": 2}'
    whole, events = await _reply(serve, tokenizer, args, tool_choice=NAMED)
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Par\x04is", "days": 2}
    content, calls, finish = _reassemble(events)
    assert content == "" and finish == "tool_calls"
    assert [c["function"] for c in calls] == [call["function"]]
    fragments = [
        d["function"]["arguments"]
        for e in events
        for choice in e["choices"]
        for d in choice["delta"].get("tool_calls", [])
        if "id" not in d
    ]
    assert len(fragments) > 1  # one per generated piece, not one at the end
