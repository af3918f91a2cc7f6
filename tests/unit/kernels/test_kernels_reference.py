"""The PyTorch paged ops against plain dense attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.metadata import build_attention_metadata


def _dense_attention(q, k, v, start_pos):
    """Naive fp64 causal attention: q [q_len, H, D] at positions start_pos.., k/v [ctx, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(q.shape[0])[:, None] + start_pos
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense(block_size):
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 8, 128
    # (cached tokens, new tokens): decodes, a fresh prompt, chunks on partial blocks.
    shapes = [(9, 1), (0, 7), (5, 3), (31, 1), (16, 16), (2, 1), (0, 1)]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # tables are not contiguous
    tables, contexts = [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        tables.append(table)
        contexts.append(cached + new)
    # Sequences 0 and 3 share their first block, as forked samples do; it is fully cached in
    # both (nobody writes it this step), which is what copy-on-write guarantees.
    shared = block_size <= min(shapes[0][0], shapes[3][0])
    if shared:
        tables[3][0] = tables[0][0]
    meta = build_attention_metadata(
        [n for _, n in shapes], [c for c, _ in shapes], tables, block_size
    )
    num_tokens = sum(n for _, n in shapes)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    kernels.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    out = kernels.paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5, key, value)

    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    row = 0
    for (cached, new), table in zip(shapes, tables):
        slots = torch.tensor([b * block_size + o for b in table for o in range(block_size)])
        slots = slots[: cached + new]
        expected = _dense_attention(query[row : row + new], flat_k[slots], flat_v[slots], cached)
        torch.testing.assert_close(out[row : row + new].double(), expected, rtol=1e-4, atol=1e-5)
        row += new
    assert shared == (block_size < 16)


def test_store_kv_writes_only_its_slots():
    cache_k = torch.randn(4, 2, 1, 3)
    cache_v = torch.randn(4, 2, 1, 3)
    before_k = cache_k.clone()
    key, value = torch.randn(2, 1, 3), torch.randn(2, 1, 3)
    kernels.store_kv(key, value, cache_k, cache_v, torch.tensor([5, 2]))
    assert torch.equal(cache_k[2, 1], key[0]) and torch.equal(cache_k[1, 0], key[1])
    assert torch.equal(cache_v[2, 1], value[0])
    untouched = [(b, o) for b in range(4) for o in range(2) if (b, o) not in {(2, 1), (1, 0)}]
    for b, o in untouched:
        assert torch.equal(cache_k[b, o], before_k[b, o])


def test_copy_and_swap_blocks_move_every_layer():
    device = torch.randn(3, 2, 6, 4, 2, 5)  # [layers, k/v, blocks, block_size, heads, dim]
    cpu = torch.zeros(3, 2, 4, 4, 2, 5)
    original = device.clone()
    kernels.copy_blocks(device, [(0, 5), (1, 4)])
    assert torch.equal(device[:, :, 5], original[:, :, 0])
    assert torch.equal(device[:, :, 4], original[:, :, 1])
    assert torch.equal(device[:, :, :4], original[:, :, :4])
    kernels.swap_blocks(device, cpu, [(2, 3), (3, 0)])
    assert torch.equal(cpu[:, :, 3], original[:, :, 2]) and torch.equal(
        cpu[:, :, 0], original[:, :, 3]
    )
    assert torch.count_nonzero(cpu[:, :, 1:3]) == 0
    device[:, :, 2:4] = 0
    kernels.swap_blocks(cpu, device, [(3, 2), (0, 3)])
    assert torch.equal(
        device, torch.cat([device[:, :, :2], original[:, :, 2:4], device[:, :, 4:]], 2)
    )
    assert torch.equal(device[:, :, 2:4], original[:, :, 2:4])
