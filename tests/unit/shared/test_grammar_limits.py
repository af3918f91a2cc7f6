"""Structured-output specs over the size limits are refused with a 400 naming the field and the
limit, before anything is compiled."""

from __future__ import annotations

import json

import pytest

from shared.errors import InvalidRequestError
from shared.structured import GrammarLimits, guided_from_body

LIMITS = GrammarLimits(max_spec_bytes=2000, max_choices=10, max_regex_bytes=50, max_depth=4)


def refused(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        guided_from_body(body, LIMITS)
    assert info.value.http_status == 400
    return info.value


def test_a_choice_list_over_the_limit_is_refused() -> None:
    error = refused({"guided_choice": [f"c{i}" for i in range(11)]})
    assert error.param == "guided_choice"
    assert "has 11 choices" in error.message and "at most 10 choices" in error.message
    assert "--max-grammar-choices" in error.message
    assert guided_from_body({"guided_choice": [f"c{i}" for i in range(10)]}, LIMITS)


def test_enum_values_count_over_all_the_enums_of_a_schema() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": list(range(6))}, "b": {"enum": list(range(5))}},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    error = refused({"response_format": fmt})
    assert error.param == "response_format" and "--max-grammar-choices" in error.message


def test_a_spec_over_the_byte_limit_is_refused() -> None:
    error = refused({"guided_grammar": 'root ::= "' + "a" * 2000 + '"'})
    assert error.param == "guided_grammar" and "at most 2000 bytes" in error.message
    assert "--max-grammar-spec-bytes" in error.message


def test_a_long_regex_or_schema_pattern_is_refused() -> None:
    assert refused({"guided_regex": "a" * 51}).param == "guided_regex"
    schema = {"type": "string", "pattern": "b" * 51}
    error = refused({"guided_json": schema})
    assert error.param == "guided_json" and "--max-grammar-regex-bytes" in error.message
    assert refused({"guided_json": json.dumps(schema)}).param == "guided_json"


def test_a_schema_nested_too_deep_is_refused_also_past_the_recursion_limit() -> None:
    schema: dict = {"type": "string"}
    for _ in range(4):
        schema = {"type": "array", "items": schema}
    assert "--max-grammar-depth" in refused({"guided_json": schema}).message
    deep = "[" * 100000 + "]" * 100000  # as a string: json.loads would overflow the stack
    big = GrammarLimits(max_spec_bytes=1 << 20, max_depth=4)
    with pytest.raises(InvalidRequestError, match="--max-grammar-depth"):
        guided_from_body({"guided_json": deep}, big)
