"""Text to token ids and back through a tokenizer; input it refuses is a client error (400)."""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequestError


def encode_text(tokenizer: Any, text: str, param: str, **kwargs: Any) -> list[int]:
    """tokenizer.encode(text) as a list; text it cannot take is a 400 naming `param`."""
    try:
        return list(tokenizer.encode(text, **kwargs))
    except Exception as exc:  # e.g. a TypeError for a lone surrogate, which is no UTF-8
        raise InvalidRequestError(
            f"{param} cannot be tokenized: {_why(text, exc)}", param=param
        ) from exc


def decode_ids(tokenizer: Any, ids: list[int], param: str, **kwargs: Any) -> str:
    """tokenizer.decode(ids); ids it cannot take are a 400 naming `param`."""
    try:
        return tokenizer.decode(ids, **kwargs)
    except Exception as exc:
        raise InvalidRequestError(f"{param} cannot be decoded: {exc}", param=param) from exc


def _why(text: str, exc: Exception) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        code = ord(text[bad.start])
        return f"it holds a lone surrogate (U+{code:04X}), which is not valid Unicode"
    return str(exc) or type(exc).__name__
