"""Structured-output constraints: validity checks shared by the gateway and the executor."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError
from shared.flags import flag


@dataclass(frozen=True)
class GrammarLimits:
    """How big a structured-output spec may be: compile time and memory grow with these, and a
    compile runs beside every other stream (on the executor's compile worker)."""

    max_spec_bytes: int = flag(
        64 * 1024, "--max-grammar-spec-bytes",
        "largest structured-output spec (schema, regex, grammar, choice list) accepted",
    )  # fmt: skip
    max_choices: int = flag(
        1000, "--max-grammar-choices",
        "most guided_choice items, or enum values in a JSON schema (all enums together)",
    )  # fmt: skip
    max_regex_bytes: int = flag(
        4096, "--max-grammar-regex-bytes", "longest guided_regex, or pattern in a JSON schema"
    )
    max_depth: int = flag(32, "--max-grammar-depth", "deepest nesting of a JSON schema")

    def __post_init__(self) -> None:
        for name in ("max_spec_bytes", "max_choices", "max_regex_bytes", "max_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_limits(kind: str, spec: str, limits: GrammarLimits, param: str = "guided") -> None:
    """Raise InvalidRequestError naming the field and the limit a spec is over (cheap: no
    grammar is built, so it may run before the spec is compiled anywhere)."""
    size = _utf8_size(spec, param)
    if size > limits.max_spec_bytes:
        raise _over(param, f"is {size} bytes", f"{limits.max_spec_bytes} bytes", "spec-bytes")
    if kind == "regex" and size > limits.max_regex_bytes:
        raise _over(param, f"is {size} bytes", f"{limits.max_regex_bytes} bytes", "regex-bytes")
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            return  # not a list: check_spec says so
        if isinstance(choices, list) and len(choices) > limits.max_choices:
            count = f"has {len(choices)} choices"
            raise _over(param, count, f"{limits.max_choices} choices", "choices")
    elif kind == "json_schema":
        try:
            schema = json.loads(spec)
        except (ValueError, RecursionError):
            depth = f"nests deeper than {limits.max_depth} levels"
            raise _over(param, depth, f"{limits.max_depth} levels", "depth") from None
        _check_schema(schema, limits, param)


def _check_schema(schema: Any, limits: GrammarLimits, param: str) -> None:
    """Depth, enum values (all enums together) and pattern lengths, walked without recursion."""
    num_values = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            nests = f"nests deeper than {limits.max_depth} levels"
            raise _over(param, nests, f"{limits.max_depth} levels", "depth")
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list):
                num_values += len(enum)
                if num_values > limits.max_choices:
                    many = f"has more than {limits.max_choices} enum values"
                    raise _over(param, many, f"{limits.max_choices} values", "choices")
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                size = _utf8_size(pattern, param)
                if size > limits.max_regex_bytes:
                    long = f"has a {size}-byte pattern"
                    raise _over(param, long, f"{limits.max_regex_bytes} bytes", "regex-bytes")
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))


def _utf8_size(text: str, param: str) -> int:
    """The UTF-8 length of a spec or pattern; a lone surrogate (which a schema given as a string
    may spell as an escape) has none, so it is refused rather than left to raise further on."""
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        raise InvalidRequestError(
            f"the {param} structured-output constraint holds a lone surrogate "
            f"(U+{ord(char):04X}), which is not valid Unicode",
            param=param,
        ) from None


def _over(param: str, what: str, limit: str, flag: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the {param} structured-output constraint {what}; this server allows at most {limit} "
        f"(--max-grammar-{flag})",
        param=param,
    )


def check_spec(kind: str, spec: str) -> None:
    """Raise InvalidRequestError if the constraint cannot be compiled (no tokenizer needed)."""
    import xgrammar

    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(spec)
        elif kind == "choice":
            # A list of non-empty JSON strings is always a valid grammar (JSON string literals
            # are EBNF literals), and parsing one of 10,000 choices takes xgrammar 2.5 s with
            # the GIL held: checking the list is enough.
            choice_ebnf(spec)
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


def guided_from_body(
    body: dict[str, Any], limits: GrammarLimits | None = None
) -> tuple[str, str] | None:
    """The structured-output constraint of the body, as (kind, spec), checked against the limits
    and for validity (blocking for a big spec: run it off the event loop)."""
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
    limits = limits or GrammarLimits()
    if name == "response_format":
        guided = _response_format(value, limits)
    elif name == "guided_json":
        if not isinstance(value, dict | str):
            raise InvalidRequestError("guided_json must be a JSON schema", param=name)
        if isinstance(value, dict):
            _check_schema(value, limits, name)  # before dumps: a deep schema would overflow it
        guided = ("json_schema", value if isinstance(value, str) else json.dumps(value))
    elif name == "guided_choice":
        if not isinstance(value, list):
            raise InvalidRequestError("guided_choice must be a list of strings", param=name)
        guided = ("choice", json.dumps(value))
    else:
        if not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string", param=name)
        guided = ("regex" if name == "guided_regex" else "grammar", value)
    check_limits(*guided, limits, param=name)
    try:
        check_spec(*guided)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param=name) from None
    return guided


def _response_format(value: Any, limits: GrammarLimits) -> tuple[str, str]:
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
    if schema is not None:
        _check_schema(schema, limits, param)
    return ("json_schema", json.dumps(schema)) if schema is not None else ("json_object", "")
