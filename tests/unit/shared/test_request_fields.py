"""Each sampling field is declared once, on SamplingParams: from that declaration it appears in
the OpenAPI schema, is parsed by the gateway and by `pagedserve generate`'s reader, crosses the
wire, and says whether the executor needs the sequence's token history."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from services.engine.offline import SAMPLING_FIELDS
from services.gateway.openai_api import parse_chat_request, parse_completion_request
from services.gateway.openapi import openapi_spec
from shared import wire
from shared.protocol import GenerateRequest
from shared.sampling import BY_NAME_FIELDS, SamplingParams
from shared.sampling_fields import REQUEST
from tests.support.gateway_fakes import CHAT, INFO

# A request value of every field a request gives by name, and the value it becomes. A new field
# must be added here, which runs it through every path below.
SAMPLES: dict[str, tuple[Any, Any]] = {
    "n": (2, 2),
    "max_tokens": (5, 5),
    "temperature": (0.5, 0.5),
    "top_p": (0.5, 0.5),
    "top_k": (3, 3),
    "seed": (7, 7),
    "stop_token_ids": ([1, 2], (1, 2)),
    "ignore_eos": (True, True),
    "logprobs": (2, 2),  # the completions endpoint's form
    "min_p": (0.1, 0.1),
    "min_tokens": (2, 2),
    "presence_penalty": (0.5, 0.5),
    "frequency_penalty": (-1.0, -1.0),
    "repetition_penalty": (1.5, 1.5),
    "logit_bias": ({"3": 1.0}, ((3, 1.0),)),
    "best_of": (3, 3),
    "use_beam_search": (True, True),
    "length_penalty": (0.5, 0.5),
    "early_stopping": ("never", "never"),
    "priority": (-3, -3),
    "prompt_logprobs": (3, 3),
}


def test_every_field_declares_how_a_request_gives_it():
    assert all(REQUEST in f.metadata for f in dataclasses.fields(SamplingParams))
    assert set(SAMPLES) == set(BY_NAME_FIELDS)
    assert SAMPLING_FIELDS == BY_NAME_FIELDS  # the offline reader takes the same fields


@pytest.mark.parametrize("name", BY_NAME_FIELDS)
def test_a_declared_field_is_in_the_schema_parsed_and_carried(name, tokenizer):
    sent, expected = SAMPLES[name]
    spec = openapi_spec("tiny")
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert name in body["schema"]["properties"]

    request = {"model": "tiny", "prompt": "the capital", name: sent}
    sampling = parse_completion_request(request, INFO, tokenizer).sampling
    assert getattr(sampling, name) == expected
    if name != "logprobs":  # chat asks for logprobs with logprobs + top_logprobs
        request = {"model": "tiny", "messages": CHAT, name: sent}
        assert getattr(parse_chat_request(request, INFO, tokenizer).sampling, name) == expected

    line = {"prompt": "the capital", name: sent}
    defaults = SamplingParams(temperature=0.0)  # `pagedserve generate`'s default is greedy
    read = SamplingParams.from_dict({k: line[k] for k in SAMPLING_FIELDS if k in line}, defaults)
    assert getattr(read, name) == expected

    carried = wire.decode(wire.encode(GenerateRequest("r", [1], sampling, 0.0))).sampling
    assert carried == sampling


def test_the_fields_that_say_so_need_the_token_history():
    assert not SamplingParams().needs_history
    for changed in (
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"repetition_penalty": 1.2},
        {"guided": ("regex", "a+")},
        {"prompt_logprobs": 0},  # every prompt token computed, none taken from the cache
    ):
        assert SamplingParams(**changed).needs_history, changed
    for changed in ({"logit_bias": ((3, 1.0),)}, {"min_tokens": 2}, {"temperature": 0.5}):
        assert not SamplingParams(**changed).needs_history, changed
