"""`GET /tokenizer_info` as vLLM serves it: what a client needs to rebuild the tokenizer."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.state import GatewayState

# Paths on the server's disk mean nothing to a client (vLLM leaves them out too).
_FILE_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path"})


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's configuration as plain JSON: its init arguments, special tokens, chat
    template, class and the context length this server allows."""
    config = {
        key: _plain(value)
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if key not in _FILE_KEYS
    }
    config = {key: value for key, value in config.items() if value is not None}
    for name, token in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        config[name] = _plain(token)
    config["tokenizer_class"] = type(tokenizer).__name__
    # The tokenizer's own limit is often a placeholder (1e30); the server's context is the real one.
    config["model_max_length"] = max_model_len
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def _plain(value: Any) -> Any:
    """JSON-safe: AddedToken and other objects as their text, containers item by item."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers.AddedToken
    return content if isinstance(content, str) else str(value)


async def handle_tokenizer_info(request: web.Request, state: GatewayState) -> web.Response:
    info = state.require_info()
    return web.json_response(tokenizer_info(state.tokenizer, info.executor.max_model_len))
