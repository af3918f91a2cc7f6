"""The CPU row kernels (kernels/csrc/cpu_rows.cpp) against the reference ops they replace."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_rows
from kernels.metadata import build_attention_metadata
from services.executor.models.layers import apply_rotary

OPS = cpu_rows.load_row_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"not built: {cpu_rows.build_error()}")

HEADS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 6, 2, 16, 160


def _step(shapes, block_size, gen):
    """A step's inputs: (cached, new) tokens per sequence, random non-contiguous tables."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
    query_lens, starts = [n for _, n in shapes], [c for c, _ in shapes]
    meta = build_attention_metadata(query_lens, starts, tables, block_size)
    rows = sum(n for _, n in shapes)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    angles = meta.positions[:, None].float() * torch.rand(HEAD_DIM // 2, generator=gen)
    angles = torch.cat((angles, angles), dim=-1)  # [rows, head_dim], rotate-half tables
    return meta, qkv, angles.cos(), angles.sin()


def _reference(meta, qkv, cos, sin, k_cache, v_cache, scale):
    """What Attention.forward does with the reference ops: rotary, store_kv, paged_attention."""
    rows = qkv.shape[0]
    q, k, v = qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
    q = apply_rotary(q.reshape(rows, HEADS, HEAD_DIM), cos[:, None], sin[:, None])
    k = apply_rotary(k.reshape(rows, KV_HEADS, HEAD_DIM), cos[:, None], sin[:, None])
    v = v.reshape(rows, KV_HEADS, HEAD_DIM)
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = kernels.paged_attention(q, k_cache, v_cache, meta, scale, k, v)
    return out.reshape(rows, -1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_rows_attention_matches_the_reference_ops(block_size):
    gen = torch.Generator().manual_seed(block_size)
    # Decodes, a verify step of four rows, a short fresh prompt, a chunk across blocks.
    shapes = [(9, 1), (20, 4), (0, 3), (31, 1), (5, 6), (0, 1)]
    meta, qkv, cos, sin = _step(shapes, block_size, gen)
    pool = torch.randn(2, NUM_BLOCKS, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    expected_pool = pool.clone()
    expected = _reference(meta, qkv, cos, sin, expected_pool[0], expected_pool[1], 0.3)

    out = OPS.rows_attention(
        qkv, cos, sin, pool[0], pool[1], meta.slot_mapping, meta.block_tables,
        meta.token_seqs, meta.positions, 0.3, HEADS, KV_HEADS,
    )  # fmt: skip

    # The K/V written are rotary's own bits (no fused multiply-add), every other slot untouched.
    assert torch.equal(pool, expected_pool)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rest_of_the_step():
    """The same row, alone or beside others: bit for bit the same (SDPA's calls are not)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(40, 1), (13, 5), (70, 1), (0, 2)]
    meta, qkv, cos, sin = _step(shapes, 16, gen)
    pool = torch.randn(2, NUM_BLOCKS, 16, KV_HEADS, HEAD_DIM, generator=gen)
    args = (meta.slot_mapping, meta.block_tables, meta.token_seqs, meta.positions)
    together = OPS.rows_attention(qkv, cos, sin, pool[0], pool[1], *args, 0.25, HEADS, KV_HEADS)
    for row in range(qkv.shape[0]):
        one = slice(row, row + 1)
        alone = OPS.rows_attention(
            qkv[one], cos[one], sin[one], pool[0], pool[1], meta.slot_mapping[one],
            meta.block_tables, meta.token_seqs[one], meta.positions[one], 0.25, HEADS, KV_HEADS,
        )  # fmt: skip
        assert torch.equal(alone[0], together[row]), row


def test_rows_attention_refuses_a_position_beyond_its_table():
    gen = torch.Generator().manual_seed(2)
    meta, qkv, cos, sin = _step([(3, 1)], 4, gen)
    pool = torch.randn(2, NUM_BLOCKS, 4, KV_HEADS, HEAD_DIM, generator=gen)
    with pytest.raises(RuntimeError, match="position beyond its table"):
        OPS.rows_attention(
            qkv, cos, sin, pool[0], pool[1], meta.slot_mapping, meta.block_tables,
            meta.token_seqs, meta.positions + 4, 0.3, HEADS, KV_HEADS,
        )  # fmt: skip


def test_norms_and_gate_match_torch():
    gen = torch.Generator().manual_seed(3)
    h, delta = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    weight = torch.rand(40, generator=gen) + 0.5
    torch.testing.assert_close(OPS.rms_norm(h, weight, 1e-5), F.rms_norm(h, (40,), weight, 1e-5))
    residual = h.clone()
    normed = OPS.add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(residual, h + delta)  # the residual stream, updated in place
    torch.testing.assert_close(normed, F.rms_norm(h + delta, (40,), weight, 1e-6))
    gate_up = torch.randn(2, 2 * 24, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gate_up), F.silu(gate) * up)


def test_a_failed_build_leaves_the_reference(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no c++ compiler\nsecond line")

    monkeypatch.setattr(cpu_rows, "_state", {})
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert cpu_rows.load_row_ops() is None
    assert "no c++ compiler" in cpu_rows.build_error()
    assert "reference ops run" in caplog.text
