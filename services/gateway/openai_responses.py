"""Build OpenAI response bodies, streaming chunks and logprobs objects for both endpoints."""

from __future__ import annotations

import json
import math
from typing import Any

from services.gateway.detokenizer import TokenTexts
from shared.protocol import SampledToken

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with a large negative.
_MIN_LOGPROB = -9999.0

OBJECT_COMPLETION = "text_completion"
OBJECT_CHAT = "chat.completion"
OBJECT_CHAT_CHUNK = "chat.completion.chunk"


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` (or a literal such as [DONE]) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_event(error: dict[str, Any]) -> dict[str, Any]:
    return {"error": error}


def logprob_value(value: float | None) -> float:
    if value is None or math.isnan(value):
        return _MIN_LOGPROB
    return max(float(value), _MIN_LOGPROB)


def completion_logprobs(
    entries: list[SampledToken], texts: TokenTexts, offset: int
) -> dict[str, list[Any]]:
    """The legacy shape: parallel lists; text_offset counts characters from `offset`."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        text = texts.text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(logprob_value(entry.logprob))
        top_logprobs.append({texts.text(t): logprob_value(lp) for t, lp in entry.top_logprobs})
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(entries: list[SampledToken], texts: TokenTexts) -> dict[str, Any]:
    def item(token_id: int, logprob: float | None) -> dict[str, Any]:
        return {
            "token": texts.text(token_id),
            "logprob": logprob_value(logprob),
            "bytes": texts.bytes(token_id),
        }

    content = [
        {
            **item(e.token_id, e.logprob),
            "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int,
    text: str | None,
    first: bool,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text or first:
        delta["content"] = text or ""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(
    object_name: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
    }
