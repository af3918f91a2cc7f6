"""The attention warm-up runs every query tile the prefill kernel can choose and the decode
kernel with and without split-K, per window setting, reading only block 0 of the pool."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import triton_prefill  # noqa: E402
from kernels.triton_warmup import prefill_query_tiles, warm_up_attention  # noqa: E402
from tests.support.triton_launches import record_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_query_tiles_follow_the_group_size_and_head_width():
    assert prefill_query_tiles(4, 4, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert prefill_query_tiles(9, 3, 80) == [1, 2, 4, 8, 16]  # group 3 pads to 4: 64 // 4 rows
    assert prefill_query_tiles(32, 8, 128) == [1, 2, 4, 8, 16]
    # Heads wider than 128 dims: 32-row tiles (their accumulators would spill at 64 rows).
    assert prefill_query_tiles(4, 4, 256) == [1, 2, 4, 8, 16, 32]
    assert prefill_query_tiles(8, 4, 256) == [1, 2, 4, 8, 16]
    assert prefill_query_tiles(8, 4, 256, tile_rows=128) == [1, 2, 4, 8, 16, 32]


def test_warm_up_covers_each_variant_and_leaves_the_pool_alone(monkeypatch):
    chosen = record_launches(monkeypatch, triton_prefill, "_prefill_kernel", "BLOCK_Q")
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(3, 16, 2, 32, generator=gen).to(DEVICE)
    v_cache = torch.randn(3, 16, 2, 32, generator=gen).to(DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    ran = warm_up_attention(k_cache, v_cache, 4, 32**-0.5, None, (None, 8, None))
    tiles = prefill_query_tiles(4, 2, 32)
    assert sorted(set(chosen)) == tiles  # each tile the kernel can choose was compiled
    for window in (None, 8):
        assert [r for k, r, w in ran if k == "prefill" and w == window] == tiles
        assert [r for k, r, w in ran if k == "decode" and w == window] == [1, 2]
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
