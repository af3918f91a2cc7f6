"""Chat messages to prompt token ids through the model's own chat template."""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidRequestError
from shared.text_codec import encode_text

# The roles an OpenAI chat request may name. Anything else would be written into the prompt as
# the template's role header, where a crafted name could open turns of its own.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Chat templates know no developer role: it is OpenAI's newer name for system.
_TEMPLATE_ROLE = {"developer": "system"}


def chat_prompt_ids(tokenizer: Any, messages: Any) -> list[int]:
    """Validate OpenAI-style messages and render them with add_generation_prompt (blocking)."""
    text = render_chat(tokenizer, validate_messages(messages))
    # The template writes any special tokens itself, as apply_chat_template(tokenize=True) does.
    return encode_text(tokenizer, text, "messages", add_special_tokens=False)


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """Validated messages (and function tools, if offered) to prompt text through the model's
    chat template; a template with no tool section gets the tools in a system prompt instead."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    extra: dict[str, Any] = {}
    if isinstance(template, str) and "tools" in template:
        if tools:
            extra["tools"] = tools
    elif tools or any(m.get("tool_calls") for m in messages):
        messages = fallback_tool_messages(messages, tools)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:  # a template may raise on roles or orders it does not support
        message = f"cannot apply the chat template: {exc}"
        raise InvalidRequestError(message, param="messages") from exc


def check_message_count(messages: list[Any], max_messages: int | None) -> None:
    if max_messages is not None and len(messages) > max_messages:
        raise InvalidRequestError(
            f"at most {max_messages} messages are allowed, got {len(messages)}", param="messages"
        )


def validate_messages(messages: Any, max_messages: int | None = None) -> list[dict[str, Any]]:
    """OpenAI-style messages to {role, content} dicts of text, the roles the template knows,
    with an assistant's tool_calls (arguments decoded, as templates expect) and a tool
    message's tool_call_id."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    check_message_count(messages, max_messages)
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with a string role", param="messages"
            )
        role = message["role"]
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role[:40]!r}",
                param=f"messages[{i}].role",
            )
        content = _content(message.get("content"), i)
        item: dict[str, Any] = {"role": _TEMPLATE_ROLE.get(role, role), "content": content}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = _tool_calls(message["tool_calls"], i)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise InvalidRequestError(
                    f"messages[{i}].tool_call_id must be a string",
                    param=f"messages[{i}].tool_call_id",
                )
            item["tool_call_id"] = call_id or ""
            if isinstance(message.get("name"), str):
                item["name"] = message["name"]
        out.append(item)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{param} must be a list", param=param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"{param}[{j}] must be an object with function.name", param=f"{param}[{j}]"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(
                f"{param}[{j}].function.arguments must be a JSON object (as a string)",
                param=f"{param}[{j}].function.arguments",
            )
        call_id = call.get("id")
        out.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{i}_{j}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


# For templates with no tool section: the Hermes format, which the default parser reads.
_FALLBACK_TOOL_PROMPT = (
    "Functions you may call:\n<tools>\n{tools}\n</tools>\n"
    'To call one, reply <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>'
)


def fallback_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Tools, calls and results written as plain text turns, for templates that know none."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            out.append({"role": "user", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        # Compact: the prompt's budget is the context's, and only the functions matter here.
        listed = "\n".join(
            json.dumps(t["function"], ensure_ascii=False, separators=(",", ":")) for t in tools
        )
        prompt = _FALLBACK_TOOL_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _content(content: Any, i: int) -> str:
    if content is None:
        return ""  # e.g. an assistant turn that only carried tool calls
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"messages[{i}].content: only text parts are supported", param="messages"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or a list of text parts", param="messages"
    )
