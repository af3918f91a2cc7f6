"""Structured-output constraints: validity checks shared by the gateway and the executor."""

from __future__ import annotations

import json

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
