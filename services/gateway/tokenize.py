"""`/tokenize` and `/detokenize` as vLLM serves them: the server's own tokenizer and template."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from services.gateway.openai_api import chat_text_chars, check_text_len, max_seq_len
from services.gateway.serving import read_json
from services.gateway.state import GatewayState
from shared.chat import chat_prompt_ids
from shared.errors import InvalidRequestError


def tokenize_body(body: Any, state: GatewayState) -> dict[str, Any]:
    """{"prompt": str} or {"messages": [...]} -> token ids (blocking: run off the loop)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    info = state.require_info()
    _check_model(body, info.model_name)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("give exactly one of `prompt` and `messages`", param="prompt")
    if "messages" in body:
        check_text_len(chat_text_chars(body["messages"]), info, state.tokenizer, "messages")
        ids = chat_prompt_ids(state.tokenizer, body["messages"])
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidRequestError("add_special_tokens must be a boolean", "add_special_tokens")
        check_text_len(len(prompt), info, state.tokenizer, "prompt")
        ids = list(state.tokenizer.encode(prompt, add_special_tokens=add_special))
    result: dict[str, Any] = {"count": len(ids), "max_model_len": max_seq_len(info), "tokens": ids}
    if body.get("return_token_strs") is True:
        result["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return result


def detokenize_body(body: Any, state: GatewayState) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    info = state.require_info()
    _check_model(body, info.model_name)
    tokens = body.get("tokens")
    vocab = info.executor.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise InvalidRequestError(
            f"tokens must be a list of token ids in [0, {vocab})", param="tokens"
        )
    return {"prompt": state.tokenizer.decode(tokens)}


def _check_model(body: dict[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise InvalidRequestError(
            f"the model `{model}` does not exist; this server serves `{model_name}`",
            param="model",
            code="model_not_found",
        )


async def handle_tokenize(request: web.Request, state: GatewayState) -> web.Response:
    body = await read_json(request)
    loop = asyncio.get_running_loop()
    return web.json_response(await loop.run_in_executor(None, tokenize_body, body, state))


async def handle_detokenize(request: web.Request, state: GatewayState) -> web.Response:
    body = await read_json(request)
    loop = asyncio.get_running_loop()
    return web.json_response(await loop.run_in_executor(None, detokenize_body, body, state))
