"""The Triton paged prefill attention against kernels.reference.paged_attention."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import reference, triton_prefill  # noqa: E402
from kernels.metadata import build_attention_metadata  # noqa: E402
from kernels.triton_prefill import paged_prefill_attention  # noqa: E402
from tests.support.triton_launches import record_launches  # noqa: E402

# The kernel runs here; the reference always runs on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    # The interpreter's fp32 -> bf16 cast truncates instead of rounding: up to 1 ulp (2^-7 rel).
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# (cached tokens, new tokens): a fresh prompt, a chunk continuing a context whose last block is
# partly filled (21 is no multiple of 8/16/32), a decode-like token, a chunk on a block boundary,
# a short chunk. Contexts stay <= 43 tokens so the interpreter runs them in about a second.
MIXED = [(0, 13), (21, 7), (37, 1), (16, 20), (40, 3)]


def _run_case(
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    share: tuple[int, int] | None = (2, 4),
    strided_query: bool = False,
) -> None:
    """Store this step's K/V with the reference, then compare kernel and reference outputs."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 8
    # Random everywhere, so a read through a wrong slot cannot match by accident.
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # tables are not contiguous
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
    if share is not None:
        # Forked sequences share full prefix blocks nobody writes this step (copy-on-write).
        a, b = share
        num_shared = min(shapes[a][0], shapes[b][0]) // block_size
        assert num_shared >= 1, "the case must share at least one block"
        tables[b][:num_shared] = tables[a][:num_shared]
    # Metadata stays on the CPU for the reference (it builds its causal masks there).
    meta = build_attention_metadata(
        [n for _, n in shapes], [c for c, _ in shapes], tables, block_size
    )
    num_tokens = sum(n for _, n in shapes)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    # Q as a slice of a fused QKV projection has non-contiguous rows; else a plain tensor.
    q_heads = num_heads + 2 * num_kv_heads if strided_query else num_heads
    query = torch.randn(num_tokens, q_heads, head_dim, generator=gen)
    k_cache, v_cache, key, value = (t.to(dtype) for t in (k_cache, v_cache, key, value))
    query = query.to(DEVICE, dtype)[:, :num_heads]
    reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    scale = head_dim**-0.5

    out = paged_prefill_attention(
        query,
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        meta.block_tables.to(DEVICE),
        meta.query_start_loc.to(DEVICE),
        meta.seq_lens.to(DEVICE),
        scale,
        max(n for _, n in shapes),
    ).cpu()

    # The reference runs in fp32 on the same (rounded) inputs; it reads the cache, not new K/V.
    expected = reference.paged_attention(
        query.cpu().float(), k_cache.float(), v_cache.float(), meta, scale
    )
    assert out.dtype == dtype and out.shape == (num_tokens, num_heads, head_dim)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_fp32(group, block_size):
    _run_case(MIXED, 2 * group, 2, 64, block_size, torch.float32, seed=group * 100 + block_size)


@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (4, 8), (2, 32)])
def test_mixed_batch_fp16(group, block_size):
    _run_case(MIXED, 2 * group, 2, 64, block_size, torch.float16, seed=7)


def test_mixed_batch_bf16():
    # bf16 is only loaded and stored; all arithmetic is fp32, which the interpreter supports.
    _run_case(MIXED, 4, 2, 64, 16, torch.bfloat16, seed=8)


def test_head_dim_128():
    _run_case([(0, 9), (19, 5), (30, 1)], 4, 2, 128, 16, torch.float32, seed=9, share=(1, 2))


def test_strided_query():
    assert not torch.randn(3, 8, 64)[:, :4].is_contiguous()
    _run_case(MIXED, 4, 2, 64, 16, torch.float32, seed=10, strided_query=True)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_one_token_tiles_pad_the_group_to_a_dot(group):
    # max_query_len == 1 gives tiles of 1-3 rows: the group is padded with idle members to
    # tl.dot's 16 rows (GROUP_PAD 16), whose outputs are never stored.
    shapes = [(5, 1), (33, 1), (16, 1), (0, 1), (24, 1)]
    _run_case(shapes, 2 * group, 2, 64, 8, torch.float32, seed=11, share=(1, 4))


def test_short_queries_pad_the_group_to_a_dot():
    # Two-token queries (a speculative verify of one proposal) with a group of 3: BLOCK_Q 2 x
    # GROUP_PAD 8 rows, 2 of every 8 idle, and a chunk of 2 starting mid-block.
    shapes = [(7, 2), (30, 2), (16, 2), (18, 2)]
    _run_case(shapes, 6, 2, 64, 16, torch.float32, seed=15, share=(1, 3))


def test_wide_heads_take_half_height_tiles(monkeypatch):
    # head_dim 256, group 2: 32-row tiles (16 query tokens), not 64, over a 40-token prompt.
    chosen = record_launches(monkeypatch, triton_prefill, "_prefill_kernel", "BLOCK_Q")
    _run_case([(0, 40), (21, 7)], 4, 2, 256, 16, torch.float32, seed=17, share=None)
    assert chosen == [16]


def test_head_dim_under_16_takes_the_broadcast_path():
    # No tl.dot below 16 in any dim: head_dim 8 multiplies and reduces in registers instead.
    _run_case(MIXED, 4, 2, 8, 16, torch.float32, seed=16)


def test_several_query_tiles_per_sequence(monkeypatch):
    # 16-row tiles with group 4 hold 4 query tokens: a 27-token chunk spans 7 tiles, each with its
    # own causal key range; a 3-row group (padded to 4) leaves idle rows in every tile.
    monkeypatch.setattr(triton_prefill, "_TILE_ROWS", 16)
    _run_case([(0, 27), (9, 18), (12, 1)], 8, 2, 64, 8, torch.float32, seed=12, share=(1, 2))
    _run_case([(0, 27), (9, 18), (12, 1)], 6, 2, 64, 8, torch.float32, seed=13, share=(1, 2))


@pytest.mark.parametrize("tile_rows, block_n", [(128, 64), (64, 64), (128, 32)])
def test_larger_tiles_and_key_steps_match_reference(monkeypatch, tile_rows, block_n):
    # The sweep's other shapes (a GPU config's "tile_rows" and "block_n"): key steps of 64 over
    # 8-token blocks, query tiles of 128 rows over a chunk that starts mid-context.
    monkeypatch.setattr(triton_prefill, "_TILE_ROWS", tile_rows)
    monkeypatch.setattr(triton_prefill, "_BLOCK_N", block_n)
    _run_case([(0, 40), (70, 9), (20, 1)], 8, 2, 64, 8, torch.float32, seed=14, share=(1, 2))


def test_empty_batch():
    query = torch.randn(0, 4, 64)
    k_cache = torch.randn(4, 16, 2, 64)
    out = paged_prefill_attention(
        query,
        k_cache,
        k_cache,
        torch.zeros(0, 1, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        0.125,
        0,
    )
    assert out.shape == (0, 4, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_medium_prefill_cuda():
    # Real tile sizes on a GPU: long prompts, chunks, decodes, GQA 4, head_dim 128, fp16.
    shapes = [(0, 517), (300, 211), (1023, 1), (64, 128), (777, 64), (0, 1), (2000, 33)]
    _run_case(shapes, 32, 8, 128, 16, torch.float16, seed=14, share=(2, 4))
    _run_case(shapes, 16, 8, 64, 32, torch.bfloat16, seed=15, share=(2, 4))


def test_a_mixed_step_sends_decode_rows_to_the_decode_kernel(monkeypatch):
    # The one-token sequence (37 cached, 1 new) of MIXED goes to the decode kernel, the four
    # multi-token ones to the prefill kernel; the outputs, put back in row order, are the
    # reference's.
    from kernels import metadata, triton_ops

    block_size, num_heads, num_kv_heads, head_dim = 16, 4, 2, 32
    gen = torch.Generator().manual_seed(3)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in MIXED) + 4
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in MIXED]
    query_lens, starts = [n for _, n in MIXED], [c for c, _ in MIXED]
    cpu_meta = build_attention_metadata(query_lens, starts, tables, block_size)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    expected = reference.paged_attention(query, k_cache, v_cache, cpu_meta, head_dim**-0.5)

    table = cpu_meta.block_tables.to(DEVICE)
    meta = metadata.metadata_from_table(
        query_lens, starts, table, block_size, reference_views=False
    )
    assert meta.mixed is not None
    calls = []
    decode, prefill = triton_ops.paged_decode_attention, triton_ops.paged_prefill_attention

    def watched_decode(q, *args, **kwargs):
        calls.append(("decode", q.shape[0]))
        return decode(q, *args, **kwargs)

    def watched_prefill(q, *args, **kwargs):
        calls.append(("prefill", q.shape[0]))
        return prefill(q, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_decode_attention", watched_decode)
    monkeypatch.setattr(triton_ops, "paged_prefill_attention", watched_prefill)
    out = triton_ops.paged_attention(
        query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta, head_dim**-0.5
    )
    assert calls == [("decode", 1), ("prefill", sum(query_lens) - 1)]
    torch.testing.assert_close(out.cpu(), expected, **TOL[torch.float32])


def test_no_split_without_both_kinds_or_for_the_reference():
    from kernels.metadata import metadata_from_table

    table = torch.zeros(2, 4, dtype=torch.int64)
    assert metadata_from_table([1, 1], [5, 9], table, 16, reference_views=False).mixed is None
    assert metadata_from_table([3, 4], [0, 9], table, 16, reference_views=False).mixed is None
    assert metadata_from_table([1, 4], [5, 9], table, 16, reference_views=True).mixed is None
    split = metadata_from_table([3, 1, 2, 1], [0, 9, 4, 7], table.repeat(2, 1), 16,
                                reference_views=False).mixed  # fmt: skip
    assert split.decode_seqs.tolist() == [1, 3] and split.decode_rows.tolist() == [3, 6]
    assert split.prefill_seqs.tolist() == [0, 2] and split.prefill_rows.tolist() == [0, 1, 2, 4, 5]
    assert split.prefill_query_start_loc.tolist() == [0, 3, 5]
    assert split.prefill_max_query_len == 3
