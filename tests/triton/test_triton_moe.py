"""The Triton fused-MoE kernels equal the grouped torch path of models/moe.py, for expert
counts above the token count, top-1 to top-4, and every token on one expert."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.triton_moe import BLOCK_M, align_by_expert, fused_moe  # noqa: E402
from services.executor.models.moe import grouped_experts, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, WIDTH = 40, 24  # neither a multiple of the kernel's tiles: masked edges


def _case(num_tokens: int, num_experts: int, top_k: int, one_expert: bool):
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts * 10 + top_k)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    gate_up = torch.randn(num_experts, 2 * WIDTH, HIDDEN, generator=gen) * 0.2
    down = torch.randn(num_experts, HIDDEN, WIDTH, generator=gen) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if one_expert:
        logits[:, 2] += 100.0  # expert 2 first for every token
    weights, ids = route(logits, top_k, renormalize=top_k > 1)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "one_expert"),
    [
        (1, 8, 2, False),  # decode of one sequence: most experts get nothing
        (2, 16, 4, False),
        (19, 4, 1, False),  # several row blocks per expert
        (21, 4, 1, True),  # every token on expert 2: one group, the rest empty
        (6, 3, 3, False),  # top_k == num_experts
    ],
)
def test_fused_moe_matches_the_grouped_torch_path(num_tokens, num_experts, top_k, one_expert):
    x, gate_up, down, weights, ids = _case(num_tokens, num_experts, top_k, one_expert)
    if one_expert:
        assert (ids[:, 0] == 2).all()
    expected = grouped_experts(x, gate_up, down, weights, ids, F.silu)
    out = fused_moe(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids)), F.silu)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_align_by_expert_groups_every_pair_once_in_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])  # expert 3 in every token
    pairs, block_experts = align_by_expert(ids, num_experts=5)
    num_pairs = ids.numel()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair once
    flat = ids.reshape(-1)
    for block, expert in enumerate(block_experts.tolist()):
        rows = pairs[block * BLOCK_M : (block + 1) * BLOCK_M]
        rows = rows[rows < num_pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:  # a block holds one expert's pairs only
            assert (flat[rows.long()] == expert).all()
    assert (block_experts >= 0).sum() == 4  # experts 0, 1, 2, 3 got pairs; expert 4 none
