"""Tool calls in chat replies: the whole message, and OpenAI's streamed tool-call deltas."""

from __future__ import annotations

import uuid
from typing import Any

from services.gateway.tool_parsers import ParsedOutput
from services.gateway.tool_request import ToolRequest, escape_controls

# How many characters of arguments go in one streamed delta once a call is complete.
ARGUMENT_FRAGMENT_CHARS = 16


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(
    tools: ToolRequest, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message for a whole reply, and its finish_reason ("tool_calls" when it
    made calls)."""
    parsed = tools.read(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if not parsed.calls:
        message["content"] = text
        return message, finish_reason
    message["tool_calls"] = [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in parsed.calls
    ]
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallStream:
    """One sample's streamed reply. Text that cannot begin a call goes out as content at once;
    from where a call may begin it is held, and at the end sent as tool-call deltas (each call's
    index, id and name first, then its arguments in fragments), or as content if it did not
    parse as calls. A named tool_choice's reply is the arguments themselves: they stream as
    they are generated."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of text already sent (as content, or named arguments)
        self.in_call = tools.forced  # a forced reply is all call
        self.head_sent = False  # named: the call's index, id and name went out

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """Content and tool-call deltas that may go out now."""
        self.text += piece
        if self.tools.choice == "named":
            return "", self._named_deltas()
        if self.in_call:
            return "", []
        end, started = self.tools.parser.content_end(self.text)
        self.in_call = started
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]], bool]:
        """Content still held (when no call parsed), the last tool-call deltas, and whether the
        reply made calls."""
        parsed: ParsedOutput = self.tools.read(self.text)
        if self.tools.choice == "named":
            return "", self._named_deltas(), bool(parsed.calls)
        if not parsed.calls:
            rest = self.text[self.sent :]
            self.sent = len(self.text)
            return rest, [], False
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            deltas.append(_head(index, call.name))
            args = call.arguments
            for at in range(0, len(args), ARGUMENT_FRAGMENT_CHARS):
                fragment = args[at : at + ARGUMENT_FRAGMENT_CHARS]
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return "", deltas, True

    def _named_deltas(self) -> list[dict[str, Any]]:
        assert self.tools.named is not None
        deltas = []
        if not self.head_sent:
            self.head_sent = True
            deltas.append(_head(0, self.tools.named))
        fragment = escape_controls(self.text[self.sent :])
        self.sent = len(self.text)
        if fragment:
            deltas.append({"index": 0, "function": {"arguments": fragment}})
        return deltas


def _head(index: int, name: str) -> dict[str, Any]:
    function = {"name": name, "arguments": ""}
    return {"index": index, "id": call_id(), "type": "function", "function": function}
