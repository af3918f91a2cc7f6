"""`/tokenize` and `/detokenize` as vLLM serves them: the server's own tokenizer and template."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.prompts import chat_prompt_ids, max_seq_len, text_prompt_ids
from services.gateway.serving import read_json
from services.gateway.state import GatewayState
from shared.errors import InvalidRequestError
from shared.protocol import SchedulerReady
from shared.text_codec import decode_ids


def tokenize_body(body: Any, state: GatewayState) -> dict[str, Any]:
    """{"prompt": str} or {"messages": [...]} -> token ids (blocking: run off the loop)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    info = state.require_info()
    _check_model(body, info)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("give exactly one of `prompt` and `messages`", param="prompt")
    if "messages" in body:
        ids = chat_prompt_ids(body["messages"], info, state.tokenizer, state.max_chat_messages)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidRequestError("add_special_tokens must be a boolean", "add_special_tokens")
        ids = text_prompt_ids(
            prompt, info, state.tokenizer, "prompt", add_special_tokens=add_special
        )
    result: dict[str, Any] = {"count": len(ids), "max_model_len": max_seq_len(info), "tokens": ids}
    if body.get("return_token_strs") is True:
        result["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return result


def detokenize_body(body: Any, state: GatewayState) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    info = state.require_info()
    _check_model(body, info)
    tokens = body.get("tokens")
    vocab = info.executor.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise InvalidRequestError(
            f"tokens must be a list of token ids in [0, {vocab})", param="tokens"
        )
    return {"prompt": decode_ids(state.tokenizer, tokens, "tokens")}


def _check_model(body: dict[str, Any], info: SchedulerReady) -> None:
    model = body.get("model")
    if model is not None and model != info.model_name and model not in info.model_aliases:
        raise InvalidRequestError(
            f"the model `{model}` does not exist; this server serves `{info.model_name}`",
            param="model",
            code="model_not_found",
        )


async def handle_tokenize(request: web.Request, state: GatewayState) -> web.Response:
    body = await read_json(request, state.inputs, state.max_chat_messages)
    return web.json_response(await state.inputs.run(body.large, tokenize_body, body.value, state))


async def handle_detokenize(request: web.Request, state: GatewayState) -> web.Response:
    body = await read_json(request, state.inputs)
    result = await state.inputs.run(body.large, detokenize_body, body.value, state)
    return web.json_response(result)
