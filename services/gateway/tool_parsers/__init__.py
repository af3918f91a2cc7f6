"""Tool-call parsers by name, and the one a chat template's own tool-call format implies."""

from __future__ import annotations

from typing import Any

from services.gateway.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from services.gateway.tool_parsers.hermes import HermesParser
from services.gateway.tool_parsers.llama3 import Llama3JsonParser
from services.gateway.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
# The parser whose format the fallback tool prompt (shared/chat.py) teaches a template without
# a tool section.
DEFAULT_PARSER = "hermes"

# A marker that only one family's template writes names its parser.
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)

__all__ = [
    "DEFAULT_PARSER",
    "PARSERS",
    "ParsedOutput",
    "ToolCall",
    "ToolParser",
    "detect_parser",
    "parser_for",
]


def detect_parser(chat_template: Any) -> str | None:
    """The parser a template's tool-call format implies, or None where it is not unambiguous."""
    if not isinstance(chat_template, str):
        return None
    found = {name for marker, name in _TEMPLATE_MARKERS if marker in chat_template}
    return found.pop() if len(found) == 1 else None


def parser_for(name: str | None, chat_template: Any) -> ToolParser:
    """The parser named by --tool-call-parser, else the template's, else the default."""
    chosen = name or detect_parser(chat_template) or DEFAULT_PARSER
    return PARSERS[chosen]()
