"""Top-k/top-p draws from each row's best candidates equal the draws over the whole vocabulary."""

from __future__ import annotations

import pytest
import torch

from services.executor import sampler
from services.executor.counter_rng import gumbel, gumbel_at, row_key
from services.executor.sampler import sample
from services.executor.sampling_state import Draw, SamplingStates
from shared.sampling import SamplingParams
from tests.support.sampling_reference import EOS, random_logits, reference_draw

VOCAB = 160
FILTERED = [
    SamplingParams(temperature=1.0, top_p=0.9, seed=1),
    SamplingParams(temperature=0.7, top_p=0.5, seed=2),
    SamplingParams(temperature=1.3, top_k=5, seed=3),
    SamplingParams(temperature=1.0, top_k=12, top_p=0.8, seed=4),
    SamplingParams(temperature=0.9, min_p=0.05, top_p=0.95, seed=5),
    SamplingParams(temperature=0.0),  # greedy rows ride along
    SamplingParams(temperature=2.0, top_p=0.99, seed=6),
]


def test_noise_at_candidates_is_the_full_race_noise():
    keys = torch.tensor([5, -7, 2**62, -(2**63)])
    ids = torch.randint(0, 1000, (4, 50), generator=torch.Generator().manual_seed(0))
    assert torch.equal(gumbel_at(keys, ids), gumbel(keys, 1000).gather(1, ids))


def _trial(trial: int, monkeypatch) -> tuple[int, int]:
    """Draw a batch of FILTERED rows, check every token against the reference; returns the
    rows that reached the second tier of candidates and those that fell back to the sort."""
    # Few candidates, so that peaked rows are decided by the first tier, flatter ones by the
    # second and the flattest fall back to the sort: all must draw the reference's token.
    monkeypatch.setattr(sampler, "CANDIDATE_TIERS", (4, 20))
    fallbacks = []
    full = sampler._top_k_top_p

    def counting(logits, top_k, top_p):
        fallbacks.append(logits.shape[0])
        return full(logits, top_k, top_p)

    monkeypatch.setattr(sampler, "_top_k_top_p", counting)
    tiers = []  # rows entering each tier of candidates

    def noise_at(keys, ids):
        tiers.append(ids.shape[0])
        return gumbel_at(keys, ids)

    monkeypatch.setattr(sampler, "gumbel_at", noise_at)
    logits = random_logits(len(FILTERED), vocab=VOCAB, seed=trial)
    logits[[1, 2]] *= 4.0  # peaked rows: their nucleus fits in a few candidates
    logits[[0, 6]] *= 0.1  # nearly flat rows: it needs most of the vocabulary
    states = SamplingStates(VOCAB, EOS, torch.device("cpu"), seed=0, make_matcher=None)
    for seq_id, p in enumerate(FILTERED):
        states.add(seq_id, p)
        states.observe(seq_id, [4, 5], 0, samples=True)
    batch = states.build([Draw(i, i) for i in range(len(FILTERED))])
    assert batch.every_row_filtered
    tokens = sample(logits.clone(), batch).token_ids.tolist()
    for seq_id, p in enumerate(FILTERED):
        key = row_key(states.seqs[seq_id].seed, 0, 0)
        assert tokens[seq_id] == reference_draw(logits[seq_id], p, key, [4, 5], []), p
    assert tiers[0] == len(FILTERED) - 1  # every row that draws; not the greedy one
    return (tiers[1] if len(tiers) > 1 else 0), sum(fallbacks)


@pytest.mark.parametrize("trial", range(8))
def test_candidate_draws_equal_the_reference(trial, monkeypatch):
    second, _ = _trial(trial, monkeypatch)
    assert second < len(FILTERED) - 1  # the first tier decided some rows


def test_every_tier_and_the_sort_decided_rows_across_trials(monkeypatch):
    # The trials are only worth something if each path drew some of the rows.
    counts = [_trial(trial, monkeypatch) for trial in range(8)]
    assert any(second > sort for second, sort in counts)  # decided by the second tier
    assert any(sort for _, sort in counts)  # drawn from the sort


def test_a_row_without_any_filter_keeps_the_whole_vocabulary_race():
    states = SamplingStates(VOCAB, EOS, torch.device("cpu"), seed=0, make_matcher=None)
    states.add(0, SamplingParams(temperature=1.0, top_p=0.5, seed=1))
    states.add(1, SamplingParams(temperature=1.0, seed=2))  # no filter: every token may win
    for seq_id in (0, 1):
        states.observe(seq_id, [4], 0, samples=True)
    assert not states.build([Draw(0, 0), Draw(1, 1)]).every_row_filtered
