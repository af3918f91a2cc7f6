"""The offline n-gram replay's counting, on hand-made streams whose answers are worked out."""

from __future__ import annotations

import dataclasses

import pytest

from services.bench.ngram_replay import ReplayCounts, lookup_bound_stream, replay_stream
from shared.config import SpeculativeConfig

# Always K proposals (no cap per matched token), so that the sums below stay small.
NGRAM_K3 = SpeculativeConfig(
    method="ngram", num_tokens=3, ngram_min=1, ngram_max=4, ngram_proposals_per_match=0
)


def test_a_fully_accepted_proposal_yields_k_plus_one_tokens_in_one_step():
    # After the prefill's token 1, the lookup finds the prompt's 1 and proposes 2, 3, 4: all
    # right, and the step's own token (5) follows them.
    counts = replay_stream(NGRAM_K3, [1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert vars(counts) == {
        "num_steps": 1,
        "num_speculating_steps": 1,
        "num_proposed": 3,
        "num_accepted": 3,
        "num_tokens": 4,
    }


def test_rejections_no_match_and_the_max_tokens_cap():
    counts = replay_stream(NGRAM_K3, [1, 2, 3, 4], [1, 2, 9, 9, 7, 7])
    # step 1: [..., 1] proposes 2, 3, 4; 2 accepted, 3 rejected, 9 drawn: 2 tokens
    # step 2: 9 never seen before: no proposal, 1 token
    # step 3: 9 seen once; one output left after this step's own token, so one proposal (9),
    #         rejected (7 drawn)
    # step 4: 7 unseen, and nothing left to propose anyway
    assert vars(counts) == {
        "num_steps": 4,
        "num_speculating_steps": 2,
        "num_proposed": 4,
        "num_accepted": 1,
        "num_tokens": 5,
    }
    summary = counts.summary(verify_row_cost=0.03)
    assert summary["acceptance_rate"] == 0.25
    assert summary["tokens_per_step"] == 1.25
    assert summary["speculating_step_fraction"] == 0.5
    assert summary["accepted_per_token"] == 0.2
    assert summary["projected_tpot_ratio"] == pytest.approx((4 + 0.03 * 4) / 5)


def test_settings_change_what_is_proposed():
    # With n-grams of at least 2 tokens, the lone 1 of step 1 matches nothing: plain decoding.
    strict = dataclasses.replace(NGRAM_K3, ngram_min=2)
    counts = replay_stream(strict, [1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert (counts.num_steps, counts.num_proposed, counts.num_tokens) == (2, 2, 4)
    assert counts.num_accepted == 2  # step 2: [1, 2] matches, proposes 3, 4: both right
    # One proposal per matched token: step 1's 1-token match proposes only 2 (then 3 is drawn);
    # step 2's [1, 2, 3] match may propose 3 but one output is left: 4, then 5 drawn.
    capped = dataclasses.replace(NGRAM_K3, ngram_proposals_per_match=1)
    counts = replay_stream(capped, [1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert (counts.num_steps, counts.num_proposed, counts.num_accepted) == (2, 2, 2)


def test_counts_add_up_and_an_empty_summary_has_no_rates():
    total = ReplayCounts()
    total.add(replay_stream(NGRAM_K3, [1, 2, 3, 4], [1, 2, 3, 4, 5]))
    total.add(replay_stream(NGRAM_K3, [1, 2, 3, 4], [1, 2, 9, 9, 7, 7]))
    assert (total.num_steps, total.num_proposed, total.num_accepted) == (5, 7, 4)
    assert ReplayCounts().summary(0.03)["tokens_per_step"] is None


def test_the_lookup_bound_takes_the_best_earlier_continuation_in_hindsight():
    # After 1 the prompt offers two continuations: 2 5 (the earlier) and 3 4 (the latest).
    prompt = [1, 2, 5, 1, 3, 4]
    bound = lookup_bound_stream(prompt, [1, 2, 5, 6, 7], k=3)
    # step 1: 2 5 accepted, 6 drawn; step 2: 7 drawn.
    assert vars(bound) == {
        "num_steps": 2,
        "num_speculating_steps": 1,
        "num_proposed": 2,
        "num_accepted": 2,
        "num_tokens": 4,
    }
    # The n-gram rule takes the latest match, 3 4 1, all wrong (2 drawn); then [1, 2] proposes
    # 5 1 (one output left after the step's own), 5 accepted, 6 drawn; then 7: three steps.
    rule = replay_stream(NGRAM_K3, prompt, [1, 2, 5, 6, 7])
    assert (rule.num_steps, rule.num_accepted) == (3, 1)
