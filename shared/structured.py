"""Structured-output constraints: validity checks shared by the gateway and the executor."""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidRequestError


def check_spec(kind: str, spec: str) -> None:
    """Raise InvalidRequestError if the constraint cannot be compiled (no tokenizer needed)."""
    import xgrammar

    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(spec)
        elif kind == "choice":
            xgrammar.Grammar.from_ebnf(choice_ebnf(spec))
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(spec)
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad specs
        raise InvalidRequestError(f"invalid {kind} constraint: {exc}", param="guided") from None


def choice_ebnf(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequestError(
            "guided_choice must be a non-empty list of non-empty strings", param="guided_choice"
        )
    # JSON string literals are valid EBNF literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


GUIDED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def guided_from_body(body: dict[str, Any]) -> tuple[str, str] | None:
    """The structured-output constraint of the body, as (kind, spec), checked for validity."""
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if (
        given == ["response_format"]
        and isinstance(body["response_format"], dict)
        and body["response_format"].get("type") == "text"
    ):
        return None
    if len(given) > 1:
        raise InvalidRequestError(
            f"give at most one structured-output field, got {', '.join(given)}", param=given[1]
        )
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        guided = _response_format(value)
    elif name == "guided_json":
        if not isinstance(value, dict | str):
            raise InvalidRequestError("guided_json must be a JSON schema", param=name)
        guided = ("json_schema", value if isinstance(value, str) else json.dumps(value))
    elif name == "guided_choice":
        if not isinstance(value, list):
            raise InvalidRequestError("guided_choice must be a list of strings", param=name)
        guided = ("choice", json.dumps(value))
    else:
        if not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string", param=name)
        guided = ("regex" if name == "guided_regex" else "grammar", value)
    try:
        check_spec(*guided)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param=name) from None
    return guided


def _response_format(value: Any) -> tuple[str, str]:
    param = "response_format"
    if not isinstance(value, dict) or value.get("type") not in ("json_object", "json_schema"):
        raise InvalidRequestError(
            "response_format.type must be one of text, json_object, json_schema", param=param
        )
    if value["type"] == "json_object":
        return ("json_object", "")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidRequestError(
            "response_format.json_schema must be an object with a `schema` object", param=param
        )
    # OpenAI allows a json_schema without `schema`: then any JSON object is valid.
    schema = spec.get("schema")
    return ("json_schema", json.dumps(schema)) if schema is not None else ("json_object", "")
