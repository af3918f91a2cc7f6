"""Penalties, logit bias, min_tokens, best_of and seeded draws through the whole engine."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.reference_model import CONTENDED_NEW_TOKENS, hf_model

EOS = 2  # the tiny model's end-of-sequence id


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(engine_config(tiny_model_dir))


@pytest.mark.parametrize("penalty", [1.1, 1.5])
def test_repetition_penalty_greedy_equals_transformers(engine, tiny_model_dir, prompts, penalty):
    chosen = [prompts[i] for i in (2, 5, 8)]
    sampling = SamplingParams(
        temperature=0.0, repetition_penalty=penalty, max_tokens=20, ignore_eos=True
    )
    ours = [o.outputs[0].token_ids for o in engine.generate(chosen, sampling)]
    model = hf_model(tiny_model_dir)
    for prompt, tokens in zip(chosen, ours):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                do_sample=False,
                repetition_penalty=penalty,
                max_new_tokens=20,
                min_new_tokens=20,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == out[0, len(prompt) :].tolist()
    plain = engine.generate(chosen[:1], SamplingParams(temperature=0.0, max_tokens=20))
    assert plain[0].outputs[0].token_ids != ours[0]  # the penalty changed something


def _openai_penalised_greedy(model, prompt, presence, frequency, steps) -> list[int]:
    """OpenAI's formula, step by step: logit -= count * frequency + (count > 0) * presence."""
    tokens = list(prompt)
    generated: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        logits = logits.clone()  # a normal tensor, editable outside inference mode
        for token in set(generated):
            count = generated.count(token)
            logits[token] -= count * frequency + presence
        nxt = int(logits.argmax())
        generated.append(nxt)
        tokens.append(nxt)
    return generated


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.0), (0.8, 0.6)])
def test_presence_and_frequency_penalties_follow_the_openai_formula(
    engine, tiny_model_dir, prompts, presence, frequency
):
    sampling = SamplingParams(
        temperature=0.0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        max_tokens=16,
        ignore_eos=True,
    )
    [out] = engine.generate([prompts[4]], sampling)
    expected = _openai_penalised_greedy(
        hf_model(tiny_model_dir), prompts[4], presence, frequency, 16
    )
    assert out.outputs[0].token_ids == expected


def test_logit_bias_of_100_forces_its_token(engine, prompts):
    sampling = SamplingParams(temperature=1.0, seed=3, logit_bias={"77": 100}, max_tokens=6)
    [out] = engine.generate([prompts[1]], sampling)
    assert out.outputs[0].token_ids == [77] * 6


def test_min_tokens_holds_back_eos(engine, prompts):
    # eos made overwhelming: without min_tokens it comes first, with it exactly after 5 tokens.
    eager = {str(EOS): 100}
    [short] = engine.generate(
        [prompts[3]], SamplingParams(temperature=0.0, logit_bias=eager, max_tokens=20)
    )
    [held] = engine.generate(
        [prompts[3]],
        SamplingParams(temperature=0.0, logit_bias=eager, min_tokens=5, max_tokens=20),
    )
    assert short.outputs[0].token_ids == [EOS]
    tokens = held.outputs[0].token_ids
    assert len(tokens) == 6 and EOS not in tokens[:5] and tokens[5] == EOS
    assert held.outputs[0].finish_reason == "stop"


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(engine, prompts):
    common = dict(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    [best] = engine.generate([prompts[6]], SamplingParams(n=2, best_of=5, **common))
    # The same seed draws the same five candidates as n=5; rank them by their own logprobs.
    [all_five] = engine.generate([prompts[6]], SamplingParams(n=5, logprobs=0, **common))
    totals = [sum(t.logprob for t in o.logprobs) for o in all_five.outputs]
    ranked = sorted(range(5), key=lambda i: -totals[i])
    expected = [all_five.outputs[i].token_ids for i in ranked[:2]]
    assert [o.token_ids for o in best.outputs] == expected
    assert [o.index for o in best.outputs] == [0, 1]
    for output, i in zip(best.outputs, ranked[:2]):
        assert output.cumulative_logprob == pytest.approx(totals[i], abs=1e-4)
    assert len({tuple(o.token_ids) for o in all_five.outputs}) == 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_draws_survive_preemption_and_batching(tiny_model_dir, contended_prompts, mode):
    params = [
        SamplingParams(
            n=1 + i % 2,
            temperature=0.9,
            top_p=0.95,
            presence_penalty=0.5 * (i % 3),
            seed=100 + i,
            max_tokens=CONTENDED_NEW_TOKENS,
            ignore_eos=True,
        )
        for i in range(len(contended_prompts))
    ]
    roomy = LLMEngine(engine_config(tiny_model_dir, num_device_blocks=1024))
    expected = roomy.generate(contended_prompts, params)
    tight = LLMEngine(
        engine_config(tiny_model_dir, block_size=8, num_device_blocks=40, preemption_mode=mode)
    )
    got = tight.generate(contended_prompts, params)
    assert tight.scheduler.num_preemptions >= 3
    for a, b in zip(expected, got):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    # Alone, a request draws what it drew in the crowd.
    alone = LLMEngine(engine_config(tiny_model_dir)).generate([contended_prompts[4]], params[4])
    assert alone[0].outputs[0].token_ids == expected[4].outputs[0].token_ids
