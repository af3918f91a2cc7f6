"""Prompt text and chat messages to token ids, refused before tokenizing when they cannot fit."""

from __future__ import annotations

import functools
from typing import Any

from shared.chat import render_chat, validate_messages
from shared.errors import InvalidRequestError
from shared.protocol import SchedulerReady
from shared.request_limits import RequestLimits
from shared.text_codec import encode_text

DEFAULT_MAX_CHAT_MESSAGES = 2048


def request_limits(info: SchedulerReady) -> RequestLimits:
    """The limits the scheduler checks too, from the same announcement."""
    return RequestLimits.of(info.executor, info.max_num_seqs)


def max_seq_len(info: SchedulerReady) -> int:
    """Longest sequence (prompt + output) the model context and the KV pool can hold."""
    return request_limits(info).max_seq_len


def text_prompt_ids(
    text: str, info: SchedulerReady, tokenizer: Any, param: str, **kwargs: Any
) -> list[int]:
    """Prompt text to token ids (blocking), refused unread when it must exceed the context."""
    check_text_len(len(text), info, tokenizer, param)
    return encode_text(tokenizer, text, param, **kwargs)


def chat_prompt_ids(
    messages: Any,
    info: SchedulerReady,
    tokenizer: Any,
    max_messages: int,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Chat messages to prompt token ids through the template (blocking), bounded at each step.

    The message count is checked before anything else is read, the text of the contents before
    the template runs, and the rendered prompt (contents plus the template's own text) before
    it is tokenized: a huge chat costs a list length, not a render and a tokenization.
    """
    validated = validate_messages(messages, max_messages)
    check_text_len(sum(len(m["content"]) for m in validated), info, tokenizer, "messages")
    text = render_chat(tokenizer, validated, tools)
    check_text_len(len(text), info, tokenizer, "messages")
    # The template writes any special tokens itself, as apply_chat_template(tokenize=True) does.
    return encode_text(tokenizer, text, "messages", add_special_tokens=False)


def check_text_len(text_chars: int, info: SchedulerReady, tokenizer: Any, param: str) -> None:
    """Refuse text that must tokenize past the context, before paying for its tokenization.

    A token's string covers at most `longest token` characters of text (byte-level tokens spell
    one byte per character, and a character is at least one byte), so text longer than
    limit x that many characters has more than `limit` tokens.
    """
    limit = max_seq_len(info)
    if text_chars > limit * _longest_token(tokenizer):
        raise InvalidRequestError(
            f"the prompt has {text_chars} characters, more than fit this server's context of "
            f"{limit} tokens",
            param=param,
            code="context_length_exceeded",
        )


@functools.cache
def _longest_token(tokenizer: Any) -> int:
    return max(1, max(len(token) for token in tokenizer.get_vocab()))
