"""The API fields beyond the basics: each is parsed into SamplingParams, or refused by name."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from services.gateway.openai_api import parse_chat_request, parse_completion_request
from services.gateway.openapi import openapi_spec
from services.gateway.request_fields import COMMON, UNSUPPORTED
from shared.errors import InvalidRequestError
from tests.support.gateway_fakes import CHAT, INFO

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _completion(tokenizer, **fields: Any):
    body = {"model": "tiny", "prompt": "the capital", **fields}
    return parse_completion_request(body, INFO, tokenizer)


def _chat(tokenizer, **fields: Any):
    return parse_chat_request({"model": "tiny", "messages": CHAT, **fields}, INFO, tokenizer)


def _refused(call, param: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        call()
    assert info.value.param == param, info.value.message
    return info.value


def test_penalties_bias_min_fields_and_best_of_reach_the_sampling_params(tokenizer):
    parsed = _completion(
        tokenizer,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.3,
        logit_bias={"17": 5, "3": -100},
        min_tokens=2,
        min_p=0.1,
        n=2,
        best_of=4,
        max_tokens=8,
    )
    s = parsed.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.3)
    assert s.logit_bias == ((3, -100.0), (17, 5.0))
    assert (s.min_tokens, s.min_p, s.n, s.best_of, s.num_samples) == (2, 0.1, 2, 4, 4)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"384": 1}}, "logit_bias"),  # outside the 384-token vocabulary
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"best_of": 17}, "best_of"),  # beyond the server's 16 sequences
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [384]}, "stop_token_ids"),  # outside the vocabulary
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}, "stream"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to isdigit(), not to int()
    ],
)
def test_bad_values_are_refused_by_name(tokenizer, fields, param):
    _refused(lambda: _completion(tokenizer, **fields), param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"echo": True}, "echo"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ],
)
def test_known_but_unsupported_chat_fields_get_a_400_naming_them(tokenizer, fields, param):
    error = _refused(lambda: _chat(tokenizer, **fields), param)
    assert error.code == "unsupported" and "not supported" in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_tool_fields_on_completions_get_a_400_naming_them(tokenizer, fields, param):
    # Chat implements tools (tests/unit/gateway/test_tool_requests.py); completions does not.
    error = _refused(lambda: _completion(tokenizer, **fields), param)
    assert error.code == "unsupported" and "not supported" in error.message


def test_unsupported_fields_with_their_neutral_values_and_unknown_fields_pass(tokenizer):
    parsed = _chat(
        tokenizer,
        tools=[],
        tool_choice="none",
        use_beam_search=False,
        user="someone",
        metadata={"k": "v"},
        some_future_extension=3,
    )
    assert parsed.sampling.guided is None
    _refused(lambda: _completion(tokenizer, suffix="!"), "suffix")
    assert _completion(tokenizer, suffix="").sampling.n == 1


def test_beam_search_fields_reach_the_sampling_params(tokenizer):
    beam = {"use_beam_search": True, "n": 3, "length_penalty": 0.5, "early_stopping": "never"}
    s = _completion(tokenizer, **beam).sampling
    assert (s.use_beam_search, s.n, s.length_penalty, s.early_stopping) == (True, 3, 0.5, "never")
    assert s.greedy  # an omitted temperature means 0 under beam search, not 1
    assert _chat(tokenizer, **beam, temperature=0).sampling.use_beam_search
    _refused(lambda: _chat(tokenizer, **beam, stream=True), "stream")
    _refused(lambda: _chat(tokenizer, **beam, temperature=0.5), "temperature")
    _refused(lambda: _chat(tokenizer, **beam, presence_penalty=0.5), "presence_penalty")
    _refused(lambda: _chat(tokenizer, use_beam_search="yes"), "use_beam_search")
    _refused(lambda: _chat(tokenizer, **{**beam, "early_stopping": 2}), "early_stopping")


def test_structured_output_fields_become_one_constraint(tokenizer):
    schema = {"name": "x", "schema": SCHEMA}
    fmt = {"type": "json_schema", "json_schema": schema}
    assert _chat(tokenizer, response_format=fmt).sampling.guided == (
        "json_schema",
        json.dumps(SCHEMA),
    )
    assert _chat(tokenizer, response_format={"type": "json_object"}).sampling.guided == (
        "json_object",
        "",
    )
    assert _chat(tokenizer, response_format={"type": "text"}).sampling.guided is None
    assert _completion(tokenizer, guided_json=SCHEMA).sampling.guided[0] == "json_schema"
    assert _completion(tokenizer, guided_regex="[ab]+").sampling.guided == ("regex", "[ab]+")
    choice = _completion(tokenizer, guided_choice=["yes", "no"]).sampling.guided
    assert choice == ("choice", '["yes", "no"]')


def test_openapi_lists_every_supported_field_and_the_tokenizer_routes():
    spec = openapi_spec("tiny")
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    properties = body["application/json"]["schema"]["properties"]
    assert set(COMMON) <= set(properties)
    assert not set(UNSUPPORTED) & set(properties)
    assert {"/v1/tokenize", "/v1/detokenize", "/tokenize", "/health"} <= set(spec["paths"])


async def test_tokenize_and_detokenize_round_trip(serve, tokenizer):
    client, _ = await serve()
    resp = await client.post("/v1/tokenize", json={"model": "tiny", "prompt": "the capital"})
    assert resp.status == 200
    body = await resp.json()
    assert body["tokens"] == tokenizer.encode("the capital")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    resp = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert (await resp.json())["prompt"] == "the capital"
    chat = await (await client.post("/tokenize", json={"messages": CHAT})).json()
    assert chat["tokens"][0] == 1  # the chat template's <|im_start|>
    resp = await client.post("/v1/detokenize", json={"tokens": [9999]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"
    resp = await client.post("/v1/tokenize", json={"prompt": "a", "messages": CHAT})
    assert resp.status == 400


async def test_openapi_json_is_served_behind_the_api_key(serve):
    client, _ = await serve(api_key="k")
    assert (await client.get("/openapi.json")).status == 401
    resp = await client.get("/openapi.json", headers={"Authorization": "Bearer k"})
    assert resp.status == 200 and (await resp.json())["openapi"].startswith("3.")


async def test_unsupported_field_over_http_is_an_openai_error(serve):
    client, backend = await serve()
    body = {"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "tools" and error["type"] == "invalid_request_error"
    assert backend.requests == []


async def test_stop_strings_wait_for_min_tokens(serve, tokenizer):
    from tests.support.gateway_fakes import REPLY

    client, _ = await serve()
    reply_ids = tokenizer.encode(REPLY)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stop": " the"}
    early = await (await client.post("/v1/completions", json=body)).json()
    assert early["choices"][0]["text"] == ""  # the reply starts with the stop string
    held = await (await client.post("/v1/completions", json=body | {"min_tokens": 3})).json()
    # Past min_tokens no later " the" occurs, so the whole reply comes back.
    assert held["choices"][0]["text"] == tokenizer.decode(reply_ids)


@pytest.mark.parametrize(
    "fields", [{"echo": True, "logprobs": 1, "max_tokens": 0}, {"prompt_logprobs": 1}]
)
def test_prompt_logprobs_are_refused_on_the_simulated_executor(tokenizer, fields):
    sim = replace(INFO, executor=replace(INFO.executor, device_type="sim"))
    body = {"model": "tiny", "prompt": "the capital", **fields}
    parse_completion_request(body, INFO, tokenizer)  # a model computes them
    _refused(lambda: parse_completion_request(body, sim, tokenizer), "prompt_logprobs")
    chat = {"model": "tiny", "messages": CHAT, "prompt_logprobs": 1}
    _refused(lambda: parse_chat_request(chat, sim, tokenizer), "prompt_logprobs")
