"""A /v1/responses body as the chat completions body that runs it: input items become messages."""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidRequestError
from shared.sampling import BY_NAME_FIELDS

# Fields with no chat equivalent here, allowed only at the value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (None, False),  # nothing is kept: a stored response could never be fetched
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "reasoning": (None, {}),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
}
# Why a non-neutral value is refused, where the field's name does not say it.
_WHY = {
    "store": "responses are not stored; send the whole conversation in `input` instead",
    "previous_response_id": "responses are not stored; send the whole conversation in `input`",
    "conversation": "responses are not stored; send the whole conversation in `input`",
}
# Sampling fields of the Responses API and vLLM's extensions, passed to the chat path as named.
_SAMPLING = tuple(name for name in BY_NAME_FIELDS if name not in ("n", "max_tokens", "best_of"))
# Where the chat path's error names a field, the name it has in a Responses body.
RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})

# The fields this server reads, for /openapi.json (sampling fields beyond these pass as named).
RESPONSES_FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "instructions": {"type": "string"},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "text": {"type": "object", "properties": {"format": {"type": "object"}}},
    "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "store": {"enum": [False]},
}


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completions body that generates this Responses body's answer."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            why = _WHY.get(name, f"`{name}` is not supported by this server")
            raise InvalidRequestError(why, param=name, code="unsupported")
    chat: dict[str, Any] = {"model": body.get("model")}
    messages = _input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("instructions must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    for name in (*_SAMPLING, "stop", "stream", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools ({type, name, parameters, ...}) in the chat shape, which nests
    all but the type under `function`."""
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(
                f"tools[{i}]: only function tools are supported, got type {kind!r}",
                param="tools",
                code="unsupported",
            )
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none", "auto", "required"; the chat path refuses anything else


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` in chat's response_format shape (the schema nested under json_schema)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text")
    if fmt.get("type") != "json_schema":
        return fmt  # {"type": "text"} or {"type": "json_object"}: the same in both APIs
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if items is None:
        raise InvalidRequestError("input is required", param="input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i), "arguments": _arguments(item, i)},
            }
            last = messages[-1] if messages else None
            # Parallel calls arrive as consecutive items; chat keeps them on one assistant turn.
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", i),
                    "content": output if isinstance(output, str) else _text(output, i),
                }
            )
        elif kind == "reasoning":
            continue  # a reasoning model's notes; this one reads only the turns themselves
        else:
            raise InvalidRequestError(
                f"input[{i}]: items of type {str(kind)[:40]!r} are not supported",
                param="input",
                code="unsupported",
            )
    return messages


def _text(content: Any, i: int) -> str:
    """A message's content: a string, or its text parts joined (images and files are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else None
                raise InvalidRequestError(
                    f"input[{i}].content: only text parts are supported, got {kind!r}",
                    param="input",
                    code="unsupported",
                )
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise InvalidRequestError(f"input[{i}].content: a part has no text", "input")
            texts.append(text)
        return "".join(texts)
    raise InvalidRequestError(
        f"input[{i}].content must be a string or a list of text parts", param="input"
    )


def _string(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"input[{i}].{name} must be a non-empty string", param="input")
    return value


def _arguments(item: dict[str, Any], i: int) -> str:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return arguments
