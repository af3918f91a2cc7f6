"""RequestLimits: the one copy of the prompt, sample-count and token-id checks."""

from __future__ import annotations

import pytest

from services.gateway.prompts import request_limits
from shared.errors import InvalidRequestError
from shared.protocol import ExecutorReady, SchedulerReady
from shared.request_limits import RequestLimits
from shared.sampling import SamplingParams

READY = ExecutorReady(
    num_device_blocks=4, num_cpu_blocks=0, block_size=8, max_model_len=64, vocab_size=100,
    eos_token_ids=(2,),
)  # fmt: skip
LIMITS = RequestLimits.of(READY, max_num_seqs=3)


def test_max_seq_len_is_the_smaller_of_the_model_context_and_the_pool():
    assert LIMITS == RequestLimits(vocab_size=100, max_seq_len=32, max_num_seqs=3)
    roomy = RequestLimits.of(ExecutorReady(64, 0, 8, 40, 100, (2,)), 3)
    assert roomy.max_seq_len == 40


def test_the_gateway_builds_the_same_limits_from_its_announcement():
    assert request_limits(SchedulerReady(READY, max_num_seqs=3, model_name="m")) == LIMITS


@pytest.mark.parametrize(
    ("tokens", "message", "code"),
    [
        ([], "empty", None),
        ([5, 100], "outside the vocabulary", None),
        ([5, True], "outside the vocabulary", None),
        ([5, 1.0], "outside the vocabulary", None),
        ([5, -1], "token id -1 is outside the vocabulary", None),
        ([False, 5], "token id False is outside the vocabulary", None),
        ([5] * 32, "no room to generate: at most 31 prompt tokens", "context_length_exceeded"),
    ],
)
def test_bad_prompts_are_refused_naming_the_param(tokens, message, code):
    with pytest.raises(InvalidRequestError, match=message) as info:
        LIMITS.check_prompt(tokens, "messages")
    assert (info.value.param, info.value.code) == ("messages", code)
    LIMITS.check_prompt([5] * 31)  # one token of room is enough


def test_every_id_of_the_vocabulary_passes_also_as_an_int_subclass():
    import enum

    class Token(enum.IntEnum):
        LAST = 99

    LIMITS.check_prompt([0, 50, 99])
    LIMITS.check_prompt([0, Token.LAST])  # an int, though not a plain one: the slow test


def test_samples_and_token_ids_are_checked_against_this_server():
    LIMITS.check_num_samples(SamplingParams(n=3))
    with pytest.raises(InvalidRequestError, match="best_of=4 exceeds .* max_num_seqs=3") as info:
        LIMITS.check_num_samples(SamplingParams(n=1, best_of=4))
    assert info.value.param == "best_of"
    for values, param in [({"stop_token_ids": (99, 100)}, "stop_token_ids"),
                          ({"logit_bias": {"100": 1.0}}, "logit_bias")]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match="token id 100 is outside") as info:
            LIMITS.check_token_ids(SamplingParams(**values))
        assert info.value.param == param
