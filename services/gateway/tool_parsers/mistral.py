"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
`[TOOL_CALLS]name[ARGS]{...}` once per call."""

from __future__ import annotations

import json

from services.gateway.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    leading_content,
    make_call,
    marker_split,
    plain,
)

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser:
    def parse(self, text: str) -> ParsedOutput:
        at = text.find(START)
        if at < 0:
            return plain(text)
        calls = _calls(text[at:])
        if not calls:
            return plain(text)
        return ParsedOutput(leading_content(text[:at]), calls)

    def content_end(self, text: str) -> tuple[int, bool]:
        return marker_split(text, START)


def _calls(text: str) -> list[ToolCall] | None:
    parts = [p.strip() for p in text.split(START)[1:]]
    calls: list[ToolCall] = []
    for part in parts:
        if part.startswith("["):  # a JSON list of calls
            try:
                items = json.loads(part, strict=False)
            except ValueError:
                return None
            found = [make_call(item) for item in items] if isinstance(items, list) else [None]
        elif ARGS in part:
            name, _, args = part.partition(ARGS)
            try:
                found = [
                    make_call({"name": name.strip(), "arguments": json.loads(args, strict=False)})
                ]
            except ValueError:
                return None
        else:
            return None
        if not found or any(c is None for c in found):
            return None
        calls.extend(c for c in found if c is not None)
    return calls
