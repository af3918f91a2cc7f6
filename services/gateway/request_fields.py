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

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}]}
_INTS = {"type": "array", "items": _INT}

# Fields both generation endpoints implement (OpenAI's, then vLLM's extensions).
COMMON: dict[str, dict[str, Any]] = {
    "model": _STR,
    "n": {**_INT, "minimum": 1, "maximum": 64},
    "best_of": {**_INT, "minimum": 1, "maximum": 64, "description": "candidates; n best kept"},
    "temperature": {**_NUM, "minimum": 0, "maximum": 100},
    "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
    "seed": _INT,
    "stop": _STOP,
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "logit_bias": {
        "type": "object",
        "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100},
        "description": "token id (as a string) -> bias added to its logit",
    },
    "response_format": {
        "type": "object",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object"},
        },
    },
    "top_k": _INT,
    "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "repetition_penalty": {**_NUM, "exclusiveMinimum": 0, "maximum": 10},
    "min_tokens": {**_INT, "minimum": 0},
    "ignore_eos": _BOOL,
    "stop_token_ids": _INTS,
    "guided_json": {"oneOf": [{"type": "object"}, _STR]},
    "guided_regex": _STR,
    "guided_choice": {"type": "array", "items": _STR},
    "guided_grammar": _STR,
    "use_beam_search": {
        **_BOOL,
        "description": "beam search: n beams, the n best hypotheses returned best first; "
        "not streamable; temperature must be 0 or omitted",
    },
    "length_penalty": {**_NUM, "description": "beam score = cumulative logprob / length ** x"},
    "early_stopping": {"oneOf": [_BOOL, {"enum": ["never"]}]},
    "priority": {
        **_INT,
        "minimum": -(2**31),
        "maximum": 2**31 - 1,
        "description": "lower is served first; needs --scheduling-policy priority",
    },
}

COMPLETION_ONLY: dict[str, dict[str, Any]] = {
    "prompt": {"oneOf": [_STR, _INTS, {"type": "array", "items": _STR, "maxItems": 1}]},
    "max_tokens": {**_INT, "minimum": 1},
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
    "max_tokens": {**_INT, "minimum": 1},
    "max_completion_tokens": {**_INT, "minimum": 1},
    "logprobs": _BOOL,
    "top_logprobs": {**_INT, "minimum": 0, "maximum": 20},
}

# Known fields we do not implement -> the values that mean "not used" and are let through.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
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
    "prompt_logprobs": (None,),
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
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "guided_decoding_backend"}
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
