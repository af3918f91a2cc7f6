"""How each sampling field appears in a request: its JSON schema, whether a request gives it by
name, and whether the sampler needs the sequence's token history for it; declared on the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

REQUEST = "request"  # field metadata key: the field's RequestField

INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}
INTS = {"type": "array", "items": INT}


@dataclass(frozen=True)
class RequestField:
    # The value's JSON schema on both generation endpoints; None where the gateway derives the
    # value from other fields, differently per endpoint (logprobs, guided).
    schema: dict[str, Any] | None
    # A request body (or a line of `pagedserve generate`'s JSONL) gives the value under the
    # field's own name.
    by_name: bool = True
    # A value other than the default makes the executor learn from every token of the sequence
    # (penalty counts, grammar state) or read the logits at every prompt position (prompt
    # logprobs), so every token must be fed to it, none skipped (no prefix-cache reuse).
    needs_history: bool = False


def request_field(
    default: Any, schema: dict[str, Any] | None, *, by_name: bool = True,
    needs_history: bool = False,
) -> Any:  # fmt: skip
    """A SamplingParams field with its request-side description."""
    return dataclasses.field(
        default=default, metadata={REQUEST: RequestField(schema, by_name, needs_history)}
    )


def by_name_fields(cls: type) -> tuple[str, ...]:
    """The fields a request gives under their own names, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata[REQUEST].by_name)


def body_schema(cls: type) -> dict[str, dict[str, Any]]:
    """Each field's JSON schema in a request body, where it has one."""
    return {
        f.name: f.metadata[REQUEST].schema
        for f in dataclasses.fields(cls)
        if f.metadata[REQUEST].schema is not None
    }


def history_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of the fields whose other values need the token history."""
    return tuple(
        (f.name, f.default) for f in dataclasses.fields(cls) if f.metadata[REQUEST].needs_history
    )
