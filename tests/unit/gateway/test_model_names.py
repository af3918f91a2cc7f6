"""Served model aliases (--served-model-name) and GET /tokenizer_info."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from services.gateway.tokenizer_info import tokenizer_info
from services.launcher import served_model_names
from tests.support.gateway_fakes import INFO, FakeBackend, chat


@pytest.fixture
def aliased(monkeypatch):
    info = dataclasses.replace(INFO, model_aliases=("alias-a", "alias-b"))
    monkeypatch.setattr(FakeBackend, "info", property(lambda self: info))


async def test_models_lists_every_served_name(serve, aliased) -> None:
    client, _ = await serve()
    body = await (await client.get("/v1/models")).json()
    assert [card["id"] for card in body["data"]] == ["tiny", "alias-a", "alias-b"]
    assert {card["max_model_len"] for card in body["data"]} == {512}
    card = await (await client.get("/v1/models/alias-b")).json()
    assert card["id"] == "alias-b" and card["object"] == "model"
    assert (await client.get("/v1/models/other")).status == 404


async def test_requests_may_name_any_alias(serve, aliased) -> None:
    client, backend = await serve()
    for name in ("tiny", "alias-a", "alias-b"):
        resp = await client.post("/v1/chat/completions", json=chat(model=name, max_tokens=2))
        assert resp.status == 200
        assert (await resp.json())["model"] == name  # answered under the name it was asked by
    resp = await client.post("/v1/chat/completions", json=chat(model="other", max_tokens=2))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "model_not_found"
    assert len(backend.requests) == 3
    resp = await client.post("/tokenize", json={"model": "alias-a", "prompt": "the capital"})
    assert resp.status == 200
    resp = await client.post("/tokenize", json={"model": "other", "prompt": "the capital"})
    assert resp.status == 400


async def test_without_aliases_only_the_model_name_is_served(serve) -> None:
    client, _ = await serve()
    body = await (await client.get("/v1/models")).json()
    assert [card["id"] for card in body["data"]] == ["tiny"]
    resp = await client.post("/v1/chat/completions", json=chat(model="alias-a", max_tokens=2))
    assert resp.status == 404


def test_served_model_names_default_to_the_model_name() -> None:
    args = argparse.Namespace(model="/models/SmolLM2-135M", served_model_name=None)
    assert served_model_names(args) == ["SmolLM2-135M"]
    args.served_model_name = ["gpt-4o", "small"]
    assert served_model_names(args) == ["gpt-4o", "small"]


async def test_tokenizer_info_describes_the_served_tokenizer(serve, tokenizer) -> None:
    client, _ = await serve()
    resp = await client.get("/tokenizer_info")
    assert resp.status == 200
    body = await resp.json()
    assert body["tokenizer_class"] == type(tokenizer).__name__
    assert body["model_max_length"] == INFO.executor.max_model_len
    assert body["chat_template"] == tokenizer.chat_template
    assert body["eos_token"] == tokenizer.eos_token
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & body.keys()


def test_tokenizer_info_is_plain_json(tokenizer) -> None:
    from tokenizers import AddedToken

    class WithObjects:
        init_kwargs = {"bos_token": AddedToken("<s>"), "extra": ("a", {"b": AddedToken("c")})}
        special_tokens_map = {"additional_special_tokens": ["<x>"]}
        chat_template = None

    info = tokenizer_info(WithObjects(), 128)
    assert info == {
        "bos_token": "<s>",
        "extra": ["a", {"b": "c"}],
        "additional_special_tokens": ["<x>"],
        "tokenizer_class": "WithObjects",
        "model_max_length": 128,
    }
