"""The checkpoint's generation_config.json sampling values (ExecutorReady.default_sampling) are
the defaults of requests that leave those fields unset; what a request sets wins."""

from __future__ import annotations

import dataclasses

from services.gateway.openai_api import parse_chat_request, parse_completion_request
from tests.support.gateway_fakes import CHAT, INFO

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
WITH_DEFAULTS = dataclasses.replace(
    INFO, executor=dataclasses.replace(INFO.executor, default_sampling=DEFAULTS)
)


def test_unset_fields_take_the_checkpoints_values(tokenizer):
    body = {"model": "tiny", "prompt": "the capital"}
    sampling = parse_completion_request(body, WITH_DEFAULTS, tokenizer).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.9, 20)
    assert sampling.repetition_penalty == 1.05
    # Without a generation config the built-in defaults stay.
    plain = parse_completion_request(body, INFO, tokenizer).sampling
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (
        1.0, 1.0, 0, 1.0,
    )  # fmt: skip


def test_what_a_request_sets_wins_null_included_as_unset(tokenizer):
    body = {"model": "tiny", "messages": CHAT, "temperature": 0, "top_k": 5, "top_p": None}
    sampling = parse_chat_request(body, WITH_DEFAULTS, tokenizer).sampling
    assert (sampling.temperature, sampling.top_k) == (0.0, 5)
    assert (sampling.top_p, sampling.repetition_penalty) == (0.9, 1.05)


def test_beam_search_takes_none_of_them(tokenizer):
    body = {"model": "tiny", "prompt": "the capital", "use_beam_search": True, "n": 2}
    sampling = parse_completion_request(body, WITH_DEFAULTS, tokenizer).sampling
    assert sampling.use_beam_search and sampling.temperature == 0.0
    assert (sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (1.0, 0, 1.0)
