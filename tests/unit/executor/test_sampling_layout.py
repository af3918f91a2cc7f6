"""A step's sampling batch reuses the previous step's fixed part only when that is still true."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.executor.counter_rng import position_key, position_keys, row_key
from services.executor.sampling_state import Draw, SamplingStates
from shared.sampling import SamplingParams
from tests.support.sampling_reference import EOS, VOCAB

PROMPT = [4, 5, 6]


def _states(params: dict[int, SamplingParams]) -> SamplingStates:
    states = SamplingStates(VOCAB, EOS, torch.device("cpu"), seed=0, make_matcher=None)
    for seq_id, p in params.items():
        states.add(seq_id, p)
        states.observe(seq_id, PROMPT, 0, samples=True)
    return states


def test_vectorised_keys_equal_the_scalar_mix():
    rng = np.random.default_rng(3)
    samples = rng.integers(0, 2**63, 500, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    positions = [0, 1, 2**40, *rng.integers(0, 2**31, 497).tolist()]
    got = position_keys(samples, positions).tolist()
    assert got == [position_key(int(s), p) for s, p in zip(samples, positions)]


def test_keys_advance_with_each_step_while_the_layout_is_reused():
    states = _states(
        {
            0: SamplingParams(temperature=0.0),
            1: SamplingParams(temperature=1.0, seed=11),
            2: SamplingParams(temperature=0.8, top_p=0.5, seed=12),
        }
    )
    draws = [Draw(0, 0), Draw(1, 1), Draw(2, 2)]
    first = states.build(draws)
    for step in range(1, 4):
        for seq_id in range(3):  # the token sampled in the step before is fed back
            states.observe(seq_id, [9], len(PROMPT) + step - 1, samples=True)
        batch = states.build(list(draws))  # a new list with equal draws, as each plan makes
        assert batch.temperature is first.temperature  # the fixed part was reused
        expected = [0, row_key(11, 0, step), row_key(12, 0, step)]
        assert batch.rng_keys.tolist() == expected


def test_a_sequence_replaced_under_the_same_id_gets_its_own_parameters():
    states = _states({0: SamplingParams(temperature=0.0), 1: SamplingParams(temperature=0.5)})
    draws = [Draw(0, 0), Draw(1, 1)]
    assert states.build(draws).temperature.tolist() == [0.0, 0.5]
    states.forget(1)
    states.add(1, SamplingParams(temperature=1.5, top_k=3, seed=4))
    states.observe(1, PROMPT, 0, samples=True)
    batch = states.build(draws)
    assert batch.temperature.tolist() == [0.0, 1.5]
    assert batch.top_k.tolist() == [VOCAB, 3] and batch.use_top_k
    assert batch.rng_keys.tolist() == [0, row_key(4, 0, 0)]


def test_other_draws_get_a_layout_of_their_own():
    states = _states({0: SamplingParams(temperature=0.0), 1: SamplingParams(temperature=0.5)})
    assert states.build([Draw(0, 0), Draw(1, 1)]).logits_rows.tolist() == [0, 1]
    batch = states.build([Draw(0, 1), Draw(1, 0)])
    assert batch.logits_rows.tolist() == [0, 1] and batch.temperature.tolist() == [0.5, 0.0]
    assert batch.rng_keys.tolist()[1] == 0 and batch.rng_keys.tolist()[0] != 0


def test_min_tokens_masks_follow_the_outputs_on_a_reused_layout():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    states = _states({0: params})
    draws = [Draw(0, 0)]
    assert 7 in states.build(draws).edit_tokens.tolist()
    states.observe(0, [9], len(PROMPT), samples=True)
    assert 7 in states.build(draws).edit_tokens.tolist()
    states.observe(0, [9], len(PROMPT) + 1, samples=True)
    assert states.build(draws).edit_tokens is None  # two outputs: no longer masked


def test_per_row_parameters_start_aligned_at_every_batch_size():
    # The fused sampler reads them; a pointer's 16-byte alignment is part of what Triton
    # compiles for, so an odd batch size must not hand it a differently aligned row.
    for rows in range(1, 10):
        params = {i: SamplingParams(temperature=0.7, top_k=5, top_p=0.9) for i in range(rows)}
        batch = _states(params).build([Draw(i, i) for i in range(rows)])
        for name in ("temperature", "top_k", "top_p", "min_p", "logits_rows"):
            tensor = getattr(batch, name)
            assert tensor.data_ptr() % 16 == 0 and tensor.shape == (rows,), (rows, name)
        assert batch.top_k.tolist() == [5] * rows
        assert batch.top_p.tolist() == pytest.approx([0.9] * rows)
