"""Chat messages to prompt token ids through the model's own chat template."""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequestError


def chat_prompt_ids(tokenizer: Any, messages: Any) -> list[int]:
    """Validate OpenAI-style messages and render them with add_generation_prompt (blocking)."""
    messages = _validate_messages(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template may raise on roles or orders it does not support
        message = f"cannot apply the chat template: {exc}"
        raise InvalidRequestError(message, param="messages") from exc
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with a string role", param="messages"
            )
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
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
