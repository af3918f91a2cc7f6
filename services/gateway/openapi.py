"""The OpenAPI 3.1 description of the HTTP API, generated from the gateway's field tables."""

from __future__ import annotations

from typing import Any

from services.gateway.request_fields import MESSAGES, supported_fields
from services.gateway.responses_request import RESPONSES_FIELDS

_ERROR = {
    "description": "OpenAI-style error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        }
    },
}
_JSON = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
_ERRORS = {str(code): _ERROR for code in (400, 401, 404, 429, 503)}


def _post(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": required,
                            "properties": properties,
                        }
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "a JSON body, or server-sent events when stream is true",
                    "content": {"application/json": {}, "text/event-stream": {}},
                },
                **_ERRORS,
            },
        }
    }


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": _JSON, **_ERRORS}}}


def openapi_spec(model_name: str | None) -> dict[str, Any]:
    tokenize = {
        "model": {"type": "string"},
        "prompt": {"type": "string"},
        "messages": MESSAGES,
        "add_special_tokens": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"},
    }
    detokenize = {
        "model": {"type": "string"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
    }
    paths = {
        "/v1/completions": _post(
            "Text completion", supported_fields("completion"), ["model", "prompt"]
        ),
        "/v1/chat/completions": _post(
            "Chat completion", supported_fields("chat"), ["model", "messages"]
        ),
        "/v1/responses": _post(
            "Responses API (text, function tools, json_schema), run as a chat completion",
            RESPONSES_FIELDS,
            ["model", "input"],
        ),
        "/v1/tokenize": _post("Token ids of a prompt or chat", tokenize, []),
        "/v1/detokenize": _post("Text of token ids", detokenize, ["tokens"]),
        "/v1/models": _get("The served model, once per name it is served under"),
        "/v1/models/{model}": _get("One model card"),
        "/tokenizer_info": _get("The tokenizer's class, configuration and chat template"),
        "/health": _get("Readiness (503 until ready)"),
        "/v1/kv_state": _get("The live KV block map: per-block references and owners, requests"),
    }
    paths["/tokenize"] = paths["/v1/tokenize"]
    paths["/detokenize"] = paths["/v1/detokenize"]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedserve",
            "version": "1",
            "description": f"OpenAI-compatible API serving {model_name or 'one model'}",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
