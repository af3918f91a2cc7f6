"""/v1/responses output: the response object, its output items and the typed stream events."""

from __future__ import annotations

import json
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; text None: just opened (no content part yet)."""
    content = [] if text is None else [text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply message ({content, tool_calls}) as Responses output items: its text as one
    message item, then a function_call item per call."""
    items = []
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(
            function_call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    if not items:
        items.append(message_item(new_id("msg"), "", "completed"))
    return items


class ResponseDraft:
    """The response object of one request, from creation to its end; `body` echoes the settings
    the request gave, as OpenAI's response object does."""

    def __init__(self, body: dict[str, Any], model: str, created_at: int) -> None:
        text = body.get("text") or {}
        self.fields: dict[str, Any] = {
            "id": new_id("resp"),
            "object": "response",
            "created_at": created_at,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": model,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": body.get("temperature", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    @property
    def id(self) -> str:
        return self.fields["id"]

    def snapshot(self) -> dict[str, Any]:
        return dict(self.fields)

    def finish(
        self, output: list[dict[str, Any]], finish_reason: str | None, usage_: dict[str, Any]
    ) -> dict[str, Any]:
        """The final object: `incomplete` when the output hit max_output_tokens."""
        incomplete = finish_reason == "length"
        self.fields.update(
            status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            output=output,
            usage=usage_,
        )
        return self.snapshot()

    def fail(self, error: dict[str, Any]) -> dict[str, Any]:
        self.fields.update(
            status="failed",
            error={"code": error.get("code") or error.get("type"), "message": error["message"]},
        )
        return self.snapshot()


class EventLog:
    """Numbers the stream's events and writes them as server-sent events named by type."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        data = json.dumps(payload, separators=(",", ":"))
        return f"event: {type_}\ndata: {data}\n\n".encode()

    def whole_item(self, output_index: int, item: dict[str, Any]) -> list[bytes]:
        """Every event of an item known whole: added, its content in one delta, done."""
        opened = dict(item, status="in_progress")
        if item["type"] == "function_call":
            opened["arguments"] = ""
            where = {"item_id": item["id"], "output_index": output_index}
            return [
                self.event("response.output_item.added", output_index=output_index, item=opened),
                self.event(
                    "response.function_call_arguments.delta", **where, delta=item["arguments"]
                ),
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"]
                ),
                self.event("response.output_item.done", output_index=output_index, item=item),
            ]
        opened["content"] = []
        text = item["content"][0]["text"] if item["content"] else ""
        return [
            self.event("response.output_item.added", output_index=output_index, item=opened),
            *self.text_opened(item["id"], output_index),
            self.text_delta(item["id"], output_index, text),
            *self.text_closed(item, output_index, text),
        ]

    def text_opened(self, item_id: str, output_index: int) -> list[bytes]:
        where = {"item_id": item_id, "output_index": output_index, "content_index": 0}
        return [self.event("response.content_part.added", **where, part=text_part(""))]

    def text_delta(self, item_id: str, output_index: int, delta: str) -> bytes:
        where = {"item_id": item_id, "output_index": output_index, "content_index": 0}
        return self.event("response.output_text.delta", **where, delta=delta, logprobs=[])

    def text_closed(self, item: dict[str, Any], output_index: int, text: str) -> list[bytes]:
        where = {"item_id": item["id"], "output_index": output_index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=text_part(text)),
            self.event("response.output_item.done", output_index=output_index, item=item),
        ]
