"""The one-token-per-sequence metadata equals the general builder's for the same step."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.metadata import decode_metadata, metadata_from_table


@pytest.mark.parametrize("reference_views", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_decode_metadata_equals_the_general_one(seed, reference_views):
    rng = random.Random(seed)
    block_size, num_seqs = 4, rng.randrange(1, 9)
    starts = [rng.randrange(0, 40) for _ in range(num_seqs)]
    width = max(-(-(s + 1) // block_size) for s in starts) + rng.randrange(0, 3)
    table = torch.randint(0, 100, (num_seqs, width), dtype=torch.int64)
    general = metadata_from_table([1] * num_seqs, starts, table, block_size, reference_views)
    fast = decode_metadata(starts, torch.tensor(starts), table, block_size, reference_views)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "positions", "block_tables"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.max_query_len == general.max_query_len == 1
    assert fast.mixed is None and general.mixed is None and fast.rope_lens is None
    if reference_views:
        ref, want = fast.reference, general.reference
        assert torch.equal(ref.decode_rows, want.decode_rows)
        assert torch.equal(ref.decode_blocks, want.decode_blocks)
        assert torch.equal(ref.decode_mask, want.decode_mask)
        assert ref.prefills == want.prefills == []
    else:
        assert fast.reference is None and general.reference is None
