"""Tool-call parsers on the formats real templates write: Qwen2.5/Hermes, Llama 3.1, Mistral."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_parsers import PARSERS, ToolCall, detect_parser, parser_for

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "CET"}}


def _call(obj: dict) -> ToolCall:
    return ToolCall(obj["name"], json.dumps(obj["arguments"]))


def test_hermes_one_call_after_text():
    text = f"Let me look.\n<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>"
    out = PARSERS["hermes"]().parse(text)
    assert out.content == "Let me look." and out.calls == [_call(WEATHER)]


def test_hermes_several_calls_and_a_missing_last_close_tag():
    text = f"<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>\n<tool_call>\n{json.dumps(TIME)}\n"
    out = PARSERS["hermes"]().parse(text)
    assert out.content is None and out.calls == [_call(WEATHER), _call(TIME)]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>',  # one bad of two
    ],
)
def test_malformed_calls_come_back_as_plain_content(text):
    out = PARSERS["hermes"]().parse(text)
    assert out.calls == [] and out.content == text


def test_llama3_json_calls_with_parameters_and_python_tag():
    one = {"name": "get_weather", "parameters": WEATHER["arguments"]}
    two = {"name": "get_time", "parameters": TIME["arguments"]}
    parser = PARSERS["llama3_json"]()
    assert parser.parse(json.dumps(one)).calls == [_call(WEATHER)]
    out = parser.parse(f"<|python_tag|>{json.dumps(one)}; {json.dumps(two)}")
    assert out.content is None and out.calls == [_call(WEATHER), _call(TIME)]
    assert parser.parse("The weather is fine.").calls == []
    broken = '{"name": "get_weather", "parameters": {'
    assert parser.parse(broken).content == broken


def test_mistral_list_and_args_formats():
    parser = PARSERS["mistral"]()
    out = parser.parse(f"[TOOL_CALLS] {json.dumps([WEATHER, TIME])}")
    assert out.content is None and out.calls == [_call(WEATHER), _call(TIME)]
    newer = f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER['arguments'])}"
    assert parser.parse(newer).calls == [_call(WEATHER)]
    bad = "[TOOL_CALLS] [{'name': 'x'}]"
    assert parser.parse(bad).calls == [] and parser.parse(bad).content == bad


def test_arguments_given_as_a_json_string_are_decoded():
    call = {"name": "f", "arguments": json.dumps({"a": 1})}
    out = PARSERS["hermes"]().parse(f"<tool_call>{json.dumps(call)}</tool_call>")
    assert out.calls == [ToolCall("f", '{"a": 1}')]


def test_streaming_holds_back_what_may_begin_a_call():
    hermes = PARSERS["hermes"]()
    assert hermes.content_end("Sure <tool") == (5, False)
    assert hermes.content_end("Sure <tool_call>{") == (5, True)
    assert hermes.content_end("Sure.") == (5, False)
    llama = PARSERS["llama3_json"]()
    assert llama.content_end("  ") == (0, False)
    assert llama.content_end(' {"na') == (0, True)
    assert llama.content_end("Hello {") == (7, False)


def test_detection_from_the_template_and_the_flag_override():
    assert detect_parser("... <tool_call>\n{{ tool_call | tojson }}</tool_call> ...") == "hermes"
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("<tool_call> [TOOL_CALLS]") is None  # ambiguous
    assert detect_parser(None) is None
    assert type(parser_for(None, None)).__name__ == "HermesParser"
    assert type(parser_for("mistral", "<tool_call>")).__name__ == "MistralParser"


def test_raw_control_characters_in_strings_come_back_escaped():
    # xgrammar's JSON strings admit raw control characters, which strict JSON refuses.
    out = PARSERS["hermes"]().parse('<tool_call>{"name": "f", "arguments": {"a": "x\x04"}}')
    assert json.loads(out.calls[0].arguments) == {"a": "x\x04"}


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", f"Checking.<tool_call>{json.dumps(WEATHER)}</tool_call>"),
        ("llama3_json", json.dumps({"name": "get_time", "parameters": TIME["arguments"]})),
        ("mistral", f"One moment. [TOOL_CALLS] {json.dumps([WEATHER, TIME])}"),
        ("hermes", "No call here, only a < sign."),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_calls_split_across_stream_pieces_reassemble_to_the_parsed_reply(parser, text, size):
    from services.gateway.tool_replies import ToolCallStream
    from services.gateway.tool_request import ToolRequest

    tools = ToolRequest([], "auto", None, True, PARSERS[parser]())
    stream = ToolCallStream(tools)
    content, deltas = "", []
    for at in range(0, len(text), size):
        piece, more = stream.feed(text[at : at + size])
        content, deltas = content + piece, deltas + more
    rest, more, called = stream.finish()
    content, deltas = content + rest, deltas + more
    whole = tools.read(text)
    assert called == bool(whole.calls)
    assert content.strip() == (whole.content or "")
    calls: dict[int, list[str]] = {}
    for d in deltas:
        name_args = calls.setdefault(d["index"], [d["function"].get("name", ""), ""])
        name_args[1] += d["function"]["arguments"]
    assert [ToolCall(n, a) for n, a in calls.values()] == whole.calls
