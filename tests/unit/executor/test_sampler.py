"""The batched sampler against a straightforward per-row reference, for every sampling option."""

from __future__ import annotations

import pytest
import torch

from services.executor.counter_rng import row_key, uniform, uniform_reference
from services.executor.sampler import sample
from services.executor.sampling_state import Draw, SamplingStates
from shared.sampling import SamplingParams
from tests.support.sampling_reference import EOS, VOCAB, random_logits, reference_draw


def _states(params: list[SamplingParams], vocab: int = VOCAB) -> SamplingStates:
    states = SamplingStates(vocab, EOS, torch.device("cpu"), seed=0, make_matcher=None)
    for seq_id, p in enumerate(params):
        states.add(seq_id, p)
    return states


def _feed(states: SamplingStates, seq_id: int, prompt: list[int], outputs: list[int]) -> None:
    """Feed a prompt, then outputs one per step, as plans do."""
    states.observe(seq_id, prompt, 0, samples=True)
    for i, token in enumerate(outputs):
        states.observe(seq_id, [token], len(prompt) + i, samples=True)


def _draw(states: SamplingStates, logits: torch.Tensor, rows: list[int] | None = None):
    rows = rows if rows is not None else list(range(logits.shape[0]))
    draws = [Draw(row, seq_id) for seq_id, row in enumerate(rows)]
    output = sample(logits.clone(), states.build(draws))  # sample() consumes its logits
    return states.results(draws, output)


OPTIONS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.6, seed=3),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.8, seed=4),
    SamplingParams(temperature=0.9, min_p=0.2, seed=5),
    SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.7, seed=6),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=2.0),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0, frequency_penalty=1.0),
    SamplingParams(temperature=1.0, logit_bias={"7": 5.0, "9": -100}, seed=7),
    SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(11,), max_tokens=9),
    SamplingParams(temperature=1.0, min_tokens=5, ignore_eos=True, stop_token_ids=(3,), seed=8),
    SamplingParams(temperature=2.0, top_k=2**31 - 1, seed=9),
]


@pytest.mark.parametrize("trial", range(6))
def test_batch_equals_the_reference_for_every_option(trial):
    # All options in one batch: each row must draw what the plain reference draws for it.
    prompt = [4, 7, 7, 11, 12]
    outputs = [[], [9], [7, 7, 13], [2, 5, 5, 5], [1, 20, 21, 22, 23, 24, 30]]
    logits = random_logits(len(OPTIONS), seed=trial)
    # Make eos and the stop tokens attractive, so the min_tokens masks matter.
    logits[:, [2, 3, 11]] += 4.0
    # ... and the generated tokens too, so the penalties decide between them and the rest.
    logits[:, [7, 5, 9, 20, 21]] += 3.0
    states = _states(OPTIONS)
    history = []
    for seq_id in range(len(OPTIONS)):
        out = outputs[(seq_id + trial) % len(outputs)]
        _feed(states, seq_id, prompt, out)
        history.append(out)
    tokens = _draw(states, logits)
    for seq_id, (p, token) in enumerate(zip(OPTIONS, tokens)):
        key = row_key(states.seqs[seq_id].seed, 0, len(history[seq_id]))
        expected = reference_draw(logits[seq_id], p, key, prompt, history[seq_id])
        assert token.token_id == expected, (seq_id, p)


def test_greedy_takes_the_argmax_and_tiny_top_p_or_top_k_one_is_greedy():
    logits = random_logits(4)
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-40, seed=1),
        SamplingParams(top_k=1, seed=3),
        SamplingParams(top_p=1e-6, seed=3),
    ):
        tokens = _draw(_states([params] * 4), logits)
        assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def _many_draws(logits_row: torch.Tensor, params: SamplingParams, count: int) -> torch.Tensor:
    """count draws from one logits row, each a distinct sample index (distinct noise)."""
    states = _states([params], vocab=logits_row.shape[0])
    for index in range(1, count):
        states.fork(0, index, index)
    draws = [Draw(0, seq_id) for seq_id in range(count)]
    return sample(logits_row[None, :], states.build(draws)).token_ids


def test_top_k_top_p_and_min_p_keep_exactly_their_tokens():
    logits = random_logits(1, vocab=20)[0]
    order = logits.argsort(descending=True).tolist()
    probs = logits.softmax(-1)
    drawn = set(_many_draws(logits, SamplingParams(top_k=3, seed=0), 400).tolist())
    assert drawn == set(order[:3])
    keep = int((probs[order].cumsum(0) - probs[order] < 0.5).sum())  # nucleus of half the mass
    drawn = set(_many_draws(logits, SamplingParams(top_p=0.5, seed=0), 400).tolist())
    assert drawn == set(order[:keep])
    kept = {t for t in range(20) if probs[t] >= 0.3 * probs.max()}
    drawn = set(_many_draws(logits, SamplingParams(min_p=0.3, seed=0), 2000).tolist())
    assert drawn == kept


def test_huge_top_k_keeps_every_token_beside_a_top_k_row():
    # Distinct but close values: a row cut to any k < 8 would lose its smallest tokens, while
    # each token keeps probability above 1/10, so 300 uncut draws show all of them.
    logits = torch.linspace(0.0, 0.5, 8).repeat(2, 1)
    params = [SamplingParams(top_k=2**31 - 1, seed=i) for i in range(300)]
    params.append(SamplingParams(top_k=1, seed=2))
    states = _states(params, vocab=8)
    draws = [Draw(0, i) for i in range(300)] + [Draw(1, 300)]
    logits[1, 5] = 2.0
    tokens = sample(logits, states.build(draws)).token_ids.tolist()
    assert set(tokens[:300]) == set(range(8))
    assert tokens[300] == 5


def test_draws_follow_the_temperature_scaled_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    tokens = _many_draws(logits, SamplingParams(temperature=2.0, seed=11), 20000)
    freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
    assert torch.allclose(freq, (logits / 2.0).softmax(-1).double(), atol=0.015)


def test_seeded_draws_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = random_logits(3, vocab=1000)
    alone = _states([params], vocab=1000)
    alone_token = _draw(alone, logits[1:2])[0].token_id
    # Same request as the middle row of a batch, beside unseeded and other seeded rows.
    crowd = _states([SamplingParams(temperature=1.0), params, SamplingParams(seed=5)], vocab=1000)
    assert _draw(crowd, logits)[1].token_id == alone_token
    # A different seed or sample index is a different stream.
    other = _states([SamplingParams(temperature=1.0, seed=1235)], vocab=1000)
    forked = _states([params], vocab=1000)
    forked.fork(0, 1, 1)
    picks = [_draw(other, logits[1:2])[0].token_id]
    picks.append(sample(logits[1:2], forked.build([Draw(0, 1)])).token_ids.item())
    assert any(p != alone_token for p in picks)


def test_logprobs_are_the_models_log_softmax():
    logits = random_logits(2, vocab=30)
    params = SamplingParams(temperature=0.7, seed=5, logprobs=3, presence_penalty=1.0)
    tokens = _draw(_states([params, SamplingParams(temperature=0.0)], vocab=30), logits)
    reference = torch.log_softmax(logits, dim=-1)
    token = tokens[0]
    assert abs(token.logprob - reference[0, token.token_id].item()) < 1e-5
    assert [i for i, _ in token.top_logprobs] == reference[0].topk(3).indices.tolist()
    values = [v for _, v in token.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert tokens[1].logprob is None and tokens[1].top_logprobs == []


def test_best_of_rows_get_their_logprob_without_top_logprobs():
    logits = random_logits(1, vocab=30)
    [token] = _draw(_states([SamplingParams(n=1, best_of=3, seed=1)], vocab=30), logits)
    expected = torch.log_softmax(logits[0], -1)[token.token_id].item()
    assert token.logprob == pytest.approx(expected, abs=1e-5)
    assert token.top_logprobs == []


def test_penalty_counts_skip_tokens_fed_again_after_recompute():
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    states = _states([params])
    _feed(states, 0, [5, 6], [7, 7, 8])
    states.build([Draw(0, 0)])  # records what was fed
    before = states.penalties.output_counts[states.seqs[0].penalty_slot].clone()
    # Recompute: prompt and outputs fed again from position 0, then the next new token.
    states.observe(0, [5, 6, 7, 7], 0, samples=False)
    states.observe(0, [8, 9], 4, samples=True)
    states.build([Draw(0, 0)])
    counts = states.penalties.output_counts[states.seqs[0].penalty_slot]
    assert counts[7].item() == 2 and counts[8].item() == 1 and counts[9].item() == 1
    assert (counts - before).abs().sum().item() == 1  # only token 9 is new
    assert states.seqs[0].num_outputs == 4


def test_counter_uniforms_match_the_scalar_definition():
    cases = [(0, 0, 0), (-5, 1, 7), (2**63 - 1, 3, 9)]
    keys = torch.tensor([row_key(seed, index, pos) for seed, index, pos in cases])
    values = uniform(keys, 300)
    for row in range(3):
        for v in (0, 1, 17, 299):
            assert values[row, v].item() == uniform_reference(keys[row].item(), v)
    assert 0.0 < values.min().item() and values.max().item() < 1.0
    assert abs(values.mean().item() - 0.5) < 0.02


def test_a_forgotten_sequence_leaves_no_penalty_pairs_to_the_next_owner_of_its_slot():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    states = _states([])
    states.add(1, params)
    states.observe(1, [10, 11, 12], 0, samples=False)  # a prompt chunk: no draw, pairs queued
    states.forget(1)
    states.add(2, params)  # takes the freed slot
    states.observe(2, [30, 31], 0, samples=True)
    batch = states.build([Draw(0, 2)])
    assert batch.penalties.prompt_mask[0].nonzero().flatten().tolist() == [30, 31]
