"""Chat messages to prompt token ids through the model's own chat template."""

from __future__ import annotations

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


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Validated messages to prompt text through the model's chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template may raise on roles or orders it does not support
        message = f"cannot apply the chat template: {exc}"
        raise InvalidRequestError(message, param="messages") from exc


def check_message_count(messages: list[Any], max_messages: int | None) -> None:
    if max_messages is not None and len(messages) > max_messages:
        raise InvalidRequestError(
            f"at most {max_messages} messages are allowed, got {len(messages)}", param="messages"
        )


def validate_messages(messages: Any, max_messages: int | None = None) -> list[dict[str, str]]:
    """OpenAI-style messages to {role, content} dicts of text, the roles the template knows."""
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
        out.append({"role": _TEMPLATE_ROLE.get(role, role), "content": content})
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
