"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (several
joined by `;`), optionally after `<|python_tag|>`."""

from __future__ import annotations

import json

from services.gateway.tool_parsers.base import ParsedOutput, ToolCall, make_call, plain

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder(strict=False)


class Llama3JsonParser:
    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return plain(text)
        calls: list[ToolCall] = []
        at = 0
        while at < len(body):
            try:
                obj, at = _DECODER.raw_decode(body, at)
            except ValueError:
                return plain(text)
            call = make_call(obj, "parameters")
            if call is None:
                return plain(text)
            calls.append(call)
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            at = len(body) - len(rest)
        return ParsedOutput(None, calls)

    def content_end(self, text: str) -> tuple[int, bool]:
        # A call is the whole reply: its first non-blank characters decide.
        head = text.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return 0, False
        if head.startswith("{") or head.startswith(PYTHON_TAG):
            return 0, True
        return len(text), False
