"""What every tool-call parser returns, and the helpers they share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text: OpenAI's function.arguments


@dataclass(frozen=True)
class ParsedOutput:
    """A model's reply split into plain text and the calls it made."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedOutput:
        """Calls found in a whole reply; a reply with a malformed call is all plain content."""

    def content_end(self, text: str) -> tuple[int, bool]:
        """How much of a reply so far is surely plain text, and whether a call starts there
        (streaming holds back what might still turn into a call)."""


def make_call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded {"name": ..., <args_key>: {...}} object, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """Where a marker may begin at the end of the text (its length if nowhere)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def marker_split(text: str, marker: str) -> tuple[int, bool]:
    at = text.find(marker)
    return (at, True) if at >= 0 else (held_back(text, marker), False)


def plain(text: str) -> ParsedOutput:
    return ParsedOutput(text, [])


def leading_content(text: str) -> str | None:
    return text.strip() or None
