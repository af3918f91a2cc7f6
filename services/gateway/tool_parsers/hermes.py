"""Hermes / Qwen2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re

from services.gateway.tool_parsers.base import (
    ParsedOutput,
    leading_content,
    make_call,
    marker_split,
    plain,
)

START = "<tool_call>"
# The last block may lack its closing tag when generation stopped on the end-of-turn token.
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser:
    def parse(self, text: str) -> ParsedOutput:
        at = text.find(START)
        if at < 0:
            return plain(text)
        calls = []
        for match in _BLOCK.finditer(text, at):
            try:
                call = make_call(json.loads(match.group(1), strict=False))
            except ValueError:
                call = None
            if call is None:
                return plain(text)
            calls.append(call)
        return ParsedOutput(leading_content(text[:at]), calls)

    def content_end(self, text: str) -> tuple[int, bool]:
        return marker_split(text, START)
