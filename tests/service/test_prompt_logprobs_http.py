"""Prompt logprobs through `pagedserve serve` and the `openai` client: echo with logprobs (also
with max_tokens 0, as lm-eval scores choices) and vLLM's prompt_logprobs on both endpoints."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.factories import random_prompts
from tests.service.stack_process import API_KEY
from tests.support.reference_model import VOCAB, hf_model

PROMPT = random_prompts([40], VOCAB, seed=11)[0]


@pytest.fixture(scope="module")
def client(stack):
    url, _, _ = stack
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[float]:
    """transformers' logprob of each prompt token after the first (fp32)."""
    with torch.inference_mode():
        logits = hf_model(tiny_model_dir)(torch.tensor([PROMPT])).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1).tolist()


def test_echo_with_max_tokens_0_scores_the_prompt_alone(stack, client, expected):
    _, model, _ = stack
    reply = client.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    (choice,) = reply.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert choice.text == "".join(lp.tokens)  # the prompt, nothing generated
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(PROMPT)


def test_echo_with_generated_tokens_lists_prompt_then_output(stack, client, expected):
    _, model, _ = stack
    reply = client.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[1 : len(PROMPT)] == pytest.approx(expected, abs=1e-4)
    assert all(v is not None for v in lp.token_logprobs[len(PROMPT) :])
    assert lp.text_offset == sorted(lp.text_offset)
    assert reply.usage.completion_tokens == 3


def test_vllm_prompt_logprobs_on_both_endpoints(stack, client, expected):
    _, model, _ = stack
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(PROMPT)
    for token_id, entry, value in zip(PROMPT[1:], scored[1:], expected):
        assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert entry[str(token_id)]["rank"] >= 1
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] or ranks[0] > 2  # the top 2 are there, and the token itself
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    scored = chat.model_extra["prompt_logprobs"]  # vLLM reports it beside the choices
    assert scored[0] is None
    assert all(len(entry) == 1 for entry in scored[1:])
    assert chat.usage.prompt_tokens == len(scored)


def test_streamed_echo_sends_the_prompt_logprobs_first(stack, client, expected):
    _, model, _ = stack
    chunks = client.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, stream=True
    )
    token_logprobs = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert len(token_logprobs) == len(PROMPT) + 3
    assert token_logprobs[0] is None
    assert token_logprobs[1 : len(PROMPT)] == pytest.approx(expected, abs=1e-4)


def test_streamed_max_tokens_0_is_refused(stack, client):
    _, model, _ = stack
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, stream=True
        )
    assert error.value.body["param"] == "stream"
