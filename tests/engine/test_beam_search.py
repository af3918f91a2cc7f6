"""Beam search on shared blocks equals transformers' beam search, token for token."""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest
import torch

from services.engine.llm_engine import LLMEngine
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.reference_model import VOCAB, hf_model

MAX_NEW = 12
PROMPTS = random_prompts([5, 17, 33, 40], VOCAB, seed=3)


@pytest.fixture(scope="module")
def ending_token(tiny_model_dir) -> int:
    """A token the model likes to emit, used as the end token so hypotheses end mid-search
    (the tiny model's own eos is almost never drawn)."""
    counts: collections.Counter[int] = collections.Counter()
    model = hf_model(tiny_model_dir)
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=30, pad_token_id=0
            )
            counts.update(out[0, len(prompt) :].tolist())
    return counts.most_common(1)[0][0]


@functools.cache
def _hf_beams(
    model_dir: Path,
    prompt: tuple[int, ...],
    width: int,
    length_penalty: float,
    early_stopping: bool | str,
    ending: int,
) -> list[list[int]]:
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=ending,
            pad_token_id=0,
        )
    rows = []
    for row in out[:, len(prompt) :].tolist():
        # transformers pads shorter hypotheses with the end token: keep the first one only.
        rows.append(row[: row.index(ending) + 1] if ending in row else row)
    return rows


def _beam_params(width: int, ending: int, **kw) -> SamplingParams:
    # ignore_eos + stop_token_ids: the ending token is the only one, as for transformers.
    return SamplingParams(
        n=width,
        max_tokens=MAX_NEW,
        temperature=0.0,
        use_beam_search=True,
        ignore_eos=True,
        stop_token_ids=(ending,),
        **kw,
    )


def _run(engine: LLMEngine, sampling: SamplingParams):
    outputs = engine.generate(
        PROMPTS, sampling, on_step=lambda e: e.scheduler.block_manager.check()
    )
    manager = engine.scheduler.block_manager
    manager.check()
    assert manager.device.num_free == manager.device.num_blocks  # nothing leaked
    assert manager.cpu.num_free == manager.cpu.num_blocks
    return outputs


def _assert_matches(tiny_model_dir, outputs, width, ending, length_penalty, early_stopping):
    reasons = []
    for prompt, output in zip(PROMPTS, outputs):
        ours = [c.token_ids for c in output.outputs]
        expected = _hf_beams(
            tiny_model_dir, tuple(prompt), width, length_penalty, early_stopping, ending
        )
        assert ours == expected, f"prompt of {len(prompt)} tokens"
        scores = [c.cumulative_logprob for c in output.outputs]
        assert all(s is not None and s < 0 for s in scores)
        reasons += [c.finish_reason for c in output.outputs]
    return reasons


@pytest.mark.parametrize("width", [2, 4, 6])
@pytest.mark.parametrize("preemption", [None, "swap", "recompute"])
def test_beams_match_transformers(tiny_model_dir, ending_token, width, preemption):
    if preemption is None:
        config = engine_config(tiny_model_dir, block_size=4, num_device_blocks=512)
    else:
        # Four groups of `width` beams in a pool that holds about two: the newest group is
        # preempted whole, again and again, and comes back by swap or by recompute.
        config = engine_config(
            tiny_model_dir,
            block_size=4,
            num_device_blocks=8 + 4 * width,
            max_num_batched_tokens=64,
            preemption_mode=preemption,
        )
    engine = LLMEngine(config)
    outputs = _run(engine, _beam_params(width, ending_token))
    reasons = _assert_matches(tiny_model_dir, outputs, width, ending_token, 1.0, False)
    assert "length" in reasons
    if width <= 4:
        # Hypotheses also end on the end token (at width 6 none of the kept ones does: their
        # longer rivals score higher within the 12-token limit).
        assert "stop" in reasons
    if preemption is not None:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
def test_length_penalty_and_early_stopping_match(
    tiny_model_dir, ending_token, early_stopping, length_penalty
):
    engine = LLMEngine(engine_config(tiny_model_dir, block_size=4, num_device_blocks=512))
    sampling = _beam_params(
        4, ending_token, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = _run(engine, sampling)
    _assert_matches(tiny_model_dir, outputs, 4, ending_token, length_penalty, early_stopping)


def test_beams_share_blocks(tiny_model_dir, ending_token):
    """The beams of a group hold fewer distinct blocks than their tables list: prompt and
    common prefixes are shared, and dropped beams give their blocks back at once."""
    engine = LLMEngine(engine_config(tiny_model_dir, block_size=4, num_device_blocks=512))
    engine.add_request(PROMPTS[3], _beam_params(6, ending_token))
    ratios = []
    while engine.has_unfinished():
        engine.step()
        manager = engine.scheduler.block_manager
        listed = sum(len(t) for t in manager.tables.values())
        if listed:
            ratios.append(manager.device.num_used / listed)
        manager.check()
    assert ratios and max(ratios) < 0.5  # 6 beams over a 40-token prompt: mostly shared


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.7},
        {"top_p": 0.9},
        {"top_k": 5},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_p": 0.1},
        {"best_of": 6},
        {"logit_bias": {"5": 1.0}},
        {"guided": ("regex", "a+")},
        {"early_stopping": "sometimes"},
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(fields):
    base = {"n": 4, "temperature": 0.0, "use_beam_search": True}
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{**base, **fields})
    assert error.value.param == next(iter(fields))
