"""The tool fields of a chat request (tools, tool_choice, parallel_tool_calls), checked, and
the constraint that forces a call when tool_choice requires one."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.tool_parsers import ParsedOutput, ToolCall, ToolParser, parser_for
from shared.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolRequest:
    """What the gateway needs to render tools into the prompt and read calls back out."""

    tools: list[dict[str, Any]]  # OpenAI function tools, as the chat template takes them
    choice: str  # "auto", "required" or "named"
    named: str | None  # the function tool_choice names
    parallel: bool
    parser: ToolParser

    def guided(self) -> tuple[str, str] | None:
        """A JSON schema the reply must follow when a call is required (None for auto): the
        named function's arguments, or a list of {name, parameters} items, one per call."""
        if self.choice == "named":
            return ("json_schema", json.dumps(self._parameters(self.named)))
        if self.choice != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": self._parameters(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return ("json_schema", json.dumps(schema))

    def read(self, text: str) -> ParsedOutput:
        """The reply as content and calls; what cannot be read as calls stays plain content."""
        if self.choice == "named":
            assert self.named is not None
            try:
                args = json.loads(text, strict=False)
            except ValueError:
                return ParsedOutput(text, [])
            if not isinstance(args, dict):
                return ParsedOutput(text, [])
            # The text itself, as streamed argument fragments spell it (see escape_controls).
            return ParsedOutput(None, [ToolCall(self.named, escape_controls(text))])
        if self.choice == "required":
            return _forced_list(text)
        parsed = self.parser.parse(text)
        if not self.parallel and len(parsed.calls) > 1:  # asked for one call: the first
            return ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed

    @property
    def forced(self) -> bool:
        return self.choice in ("named", "required")

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise AssertionError(name)


def tool_request(
    body: dict[str, Any], parser_name: str | None, chat_template: Any
) -> ToolRequest | None:
    """The request's tool fields checked (400s name the field); None when no tool is offered
    or tool_choice is "none" (then the tools are not rendered either, as OpenAI's model
    is not offered them)."""
    tools = _tools(body.get("tools"))
    choice, named = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequestError(
            "parallel_tool_calls must be a boolean", param="parallel_tool_calls"
        )
    if not tools or choice == "none":
        return None
    return ToolRequest(tools, choice, named, parallel, parser_for(parser_name, chat_template))


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools")
    names: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f'{param} must be an object with type "function"', param="tools"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{param}.function must be an object", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise InvalidRequestError(
                f"{param}.function.name must be a string of 1 to 64 characters",
                param="tools",
            )
        if name in names:
            raise InvalidRequestError(
                f"{param}.function.name {name!r} is given twice", param="tools"
            )
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"{param}.function.parameters must be a JSON schema object",
                param="tools",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{param}.function.description must be a string",
                param="tools",
            )
        out.append({"type": "function", "function": function})
    return out


def _choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise InvalidRequestError(
                'tool_choice "required" needs at least one tool', param="tool_choice"
            )
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)
    ):
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return "named", name


def escape_controls(text: str) -> str:
    """Raw control characters (which xgrammar's JSON strings admit) as JSON escapes, so that a
    strict parser reads the arguments; piece by piece it gives the same as on the whole."""
    return _CONTROLS.sub(lambda m: json.dumps(m.group())[1:-1], text)


_CONTROLS = re.compile(r"[\x00-\x1f]")


def _forced_list(text: str) -> ParsedOutput:
    try:
        items = json.loads(text, strict=False)
    except ValueError:
        return ParsedOutput(text, [])
    calls = []
    for item in items if isinstance(items, list) else [None]:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return ParsedOutput(text, [])
        args = item.get("parameters")
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return ParsedOutput(None, calls)
