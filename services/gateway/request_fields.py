"""Every request field the gateway knows, in one place: supported, refused, or accepted and unused.

A field of OpenAI's or vLLM's API that we do not implement is refused with a 400 naming it,
unless it holds its neutral value (so clients that always send `"tools": []` still work).
Fields nobody defines are ignored, as OpenAI's own server ignores unknown extensions. The
OpenAPI description (`/openapi.json`) is generated from the same tables.
"""

from __future__ import annotations

from typing import Any

from shared.chat import ROLES
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from shared.sampling_fields import BOOL as _BOOL
from shared.sampling_fields import INT as _INT
from shared.sampling_fields import INTS as _INTS
from shared.sampling_fields import STR as _STR
from shared.sampling_fields import body_schema

_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}]}

# Fields both generation endpoints implement (OpenAI's, then vLLM's extensions): the sampling
# fields as shared/sampling.py declares them, then the ones the gateway itself reads.
COMMON: dict[str, dict[str, Any]] = {
    **body_schema(SamplingParams),
    "model": _STR,
    "stop": _STOP,
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "response_format": {
        "type": "object",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object"},
        },
    },
    "guided_json": {"oneOf": [{"type": "object"}, _STR]},
    "guided_regex": _STR,
    "guided_choice": {"type": "array", "items": _STR},
    "guided_grammar": _STR,
}

COMPLETION_ONLY: dict[str, dict[str, Any]] = {
    "prompt": {"oneOf": [_STR, _INTS, {"type": "array", "items": _STR, "maxItems": 1}]},
    "echo": _BOOL,
    "logprobs": {**_INT, "minimum": 0, "maximum": 5},
}

# What shared/chat.py accepts: one of its roles, content as text or a list of text parts.
MESSAGES: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": sorted(ROLES)},
            "content": {"type": "string"},
        },
    },
}

CHAT_ONLY: dict[str, dict[str, Any]] = {
    "messages": MESSAGES,
    "max_completion_tokens": {**_INT, "minimum": 1},
    "logprobs": _BOOL,
    "top_logprobs": {**_INT, "minimum": 0, "maximum": 20},
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {"type": {"enum": ["function"]}, "function": {"type": "object"}},
        },
    },
    "tool_choice": {
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"]},
        ]
    },
    "parallel_tool_calls": _BOOL,
}

# Known fields we do not implement -> the values that mean "not used" and are let through.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools@completion": (None, []),
    "tool_choice@completion": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "guided_whitespace_pattern": (None,),
    "echo@chat": (None, False),  # echo is a completions field; vLLM's chat echo is not ours
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "add_generation_prompt@chat": (None, True),
    "continue_final_message@chat": (None, False),
    "chat_template_kwargs@chat": (None, {}),
}

# Fields that change nothing we compute (bookkeeping for OpenAI's platform): accepted.
ACCEPTED_UNUSED = frozenset(
    {"user", "metadata", "store", "service_tier", "guided_decoding_backend"}
)


def supported_fields(kind: str) -> dict[str, dict[str, Any]]:
    return {**COMMON, **(COMPLETION_ONLY if kind == "completion" else CHAT_ONLY)}


def reject_unsupported(body: dict[str, Any], kind: str) -> None:
    """400 for a known field we do not implement, unless it carries its neutral value."""
    for name, neutral in UNSUPPORTED.items():
        field, _, only = name.partition("@")
        if only and only != kind:
            continue
        if field in supported_fields(kind) and not only:
            continue
        if field in body and not any(_same(body[field], v) for v in neutral):
            raise InvalidRequestError(
                f"`{field}` is not supported by this server", param=field, code="unsupported"
            )


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral or (value is None and neutral is None)
