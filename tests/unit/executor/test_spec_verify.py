"""Speculative verification: greedy rows keep the longest matching prefix, a deterministic
proposal is accepted with the target's probability and replaced by a draw from the rest, and
Leviathan's rule with draft probabilities leaves the target's distribution unchanged."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from services.executor.counter_rng import position_key, sample_key
from services.executor.sampler import SamplingBatch, sample
from services.executor.spec_verify import verify

VOCAB = 6
DRAWS = 4000


def test_greedy_keeps_the_longest_matching_prefix_then_the_targets_token():
    assert verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, bonus token
    assert verify([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the first mismatch is corrected
    assert verify([4, 6, 7, 8], [5, 6, 7]) == [4]  # nothing accepted
    assert verify([3], []) == [3]


def _batch(logits: torch.Tensor, keys: list[int]) -> SamplingBatch:
    rows = logits.shape[0]
    return SamplingBatch(
        logits_rows=torch.arange(rows),
        rows_identity=True,
        temperature=torch.ones(rows),
        top_k=torch.full((rows,), VOCAB),
        max_top_k=1,
        top_p=torch.full((rows,), float("inf")),
        min_p=torch.zeros(rows),
        rng_keys=torch.tensor(keys, dtype=torch.int64),
        all_greedy=False,
        use_top_k=False,
        use_top_p=False,
        use_min_p=False,
        num_logprobs=-1,
        want_filtered=True,
    )


def _first_tokens(logits_row: torch.Tensor, proposal: int, draft: torch.Tensor | None) -> list[int]:
    """The first token kept at one verified row, over DRAWS independent keys."""
    keys = [position_key(sample_key(seed, 0), 0) for seed in range(DRAWS)]
    logits = logits_row.expand(DRAWS, VOCAB).clone()
    out = sample(logits.clone(), _batch(logits, keys))
    firsts = []
    for i in range(DRAWS):
        kept = verify(
            [int(out.token_ids[i]), 0],
            [proposal],
            None if draft is None else draft[None, :],
            out.filtered[i : i + 1].expand(2, VOCAB),
            torch.tensor([keys[i], keys[i] + 1]),
            greedy=False,
        )
        firsts.append(kept[0])
    return firsts


def _assert_distributed_as(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probs.double() / probs.double().sum() * len(tokens)
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_a_deterministic_proposal_is_accepted_with_the_targets_probability():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    p = torch.softmax(logits, dim=-1)
    firsts = _first_tokens(logits, proposal=1, draft=None)
    _assert_distributed_as(firsts, p)  # accepted token 1 plus the redraws: p itself
    accepted = sum(t == 1 for t in firsts) / DRAWS
    assert abs(accepted - float(p[1])) < 0.03


def test_leviathans_rule_with_draft_probabilities_keeps_the_target_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.tensor([0.0, 2.5, 0.0, 1.0, 0.0, 0.0]), dim=-1)
    # The proposal is drawn from q; the kept first token must be distributed as p.
    proposals = torch.multinomial(
        q, DRAWS, replacement=True, generator=torch.Generator().manual_seed(3)
    )
    keys = [position_key(sample_key(seed, 7), 0) for seed in range(DRAWS)]
    batch_logits = logits.expand(DRAWS, VOCAB).clone()
    out = sample(batch_logits.clone(), _batch(batch_logits, keys))
    firsts = [
        verify(
            [int(out.token_ids[i]), 0],
            [int(proposals[i])],
            q[None, :],
            out.filtered[i : i + 1].expand(2, VOCAB),
            torch.tensor([keys[i], keys[i] + 1]),
            greedy=False,
        )[0]
        for i in range(DRAWS)
    ]
    _assert_distributed_as(firsts, p)


def test_the_residual_draw_never_returns_a_token_the_target_prefers_less_than_the_draft():
    # p - q <= 0 wherever q >= p: a rejected proposal is replaced from where p exceeds q only.
    logits = torch.log(torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]))
    q = torch.tensor([0.0, 0.9, 0.02, 0.02, 0.03, 0.03])
    keys = [position_key(sample_key(seed, 1), 0) for seed in range(500)]
    for key in keys:
        kept = verify(
            [0, 0], [1], q[None, :], logits.expand(2, VOCAB), torch.tensor([key, key]), greedy=False
        )
        assert kept[0] != 1 or len(kept) == 2
        if len(kept) == 1:
            assert kept[0] in (0, 2, 3, 4, 5) and q[kept[0]] < torch.exp(logits)[kept[0]]
