"""How many tokens an n-gram match proposes: capped per matched token, and the method's own
default K."""

from __future__ import annotations

import pytest

from services.scheduler.ngram_proposer import propose_ngram
from services.scheduler.sequence import Sequence, SequenceGroup
from services.scheduler.speculation import Speculation
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams

LOOP = [5, 6, 7, 8, 9, 5, 6, 7]  # its last 3 tokens occurred before, followed by 8, 9, 5, 6, 7


def test_a_short_match_proposes_few_tokens_and_a_long_one_many():
    assert propose_ngram([1, 2, 3, 4, 1], 8, 1, 4, per_match=2) == [2, 3]  # 1 matched: 2
    assert propose_ngram(LOOP, 8, 1, 4, per_match=1) == [8, 9, 5]  # 3 matched: 3
    assert propose_ngram(LOOP, 8, 1, 4, per_match=2) == [8, 9, 5, 6, 7]  # 6 allowed, 5 known
    assert propose_ngram(LOOP, 2, 1, 4, per_match=2) == [8, 9]  # k still caps
    assert propose_ngram([1, 2, 3, 4, 1], 8, 1, 4, per_match=0) == [2, 3, 4, 1]  # no cap


def test_the_match_is_measured_up_to_ngram_max():
    # The suffix matches 3 tokens back, but n_max = 2 stops the count at 2: 2 * 2 proposals.
    assert propose_ngram(LOOP, 8, 1, 2, per_match=2) == [8, 9, 5, 6]


def test_the_per_match_cap_is_off_by_default_and_never_negative():
    assert SpeculativeConfig(method="ngram").num_tokens == 3
    assert SpeculativeConfig(method="ngram").ngram_proposals_per_match == 0
    with pytest.raises(ValueError, match="ngram_proposals_per_match"):
        SpeculativeConfig(method="ngram", ngram_proposals_per_match=-1)


def test_speculation_applies_the_cap_per_matched_token():
    group = SequenceGroup(
        "r", 0, SamplingParams(max_tokens=100), [Sequence(0, 0, list(LOOP), len(LOOP))]
    )
    seq = group.seqs[0]
    capped = Speculation(
        SpeculativeConfig("ngram", num_tokens=8, ngram_proposals_per_match=1), 1000
    )
    assert capped.propose(group, seq, room=100) == [8, 9, 5]
    uncapped = Speculation(
        SpeculativeConfig("ngram", num_tokens=8, ngram_proposals_per_match=0), 1000
    )
    assert uncapped.propose(group, seq, room=100) == [8, 9, 5, 6, 7]
