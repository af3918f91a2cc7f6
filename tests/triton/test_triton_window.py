"""Sliding-window attention in the Triton decode and prefill kernels equals the reference, and the
kernels never read a block wholly before the window (the block manager may have freed it)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import reference  # noqa: E402
from kernels.metadata import build_attention_metadata  # noqa: E402
from kernels.triton_decode import paged_decode_attention  # noqa: E402
from kernels.triton_prefill import paged_prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 8


def _case(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, window: int):
    """Random cache, tables and queries for (cached, new) token counts per sequence, this step's
    K/V stored; also the tables with every block wholly before the window of the sequence's first
    query pointed at a block of NaN, as a freed and reused block could hold."""
    head_dim = 16
    gen = torch.Generator().manual_seed(len(shapes) * 10 + num_heads + window)
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in shapes) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    poisoned = num_blocks - 1
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))] for c, n in shapes]
    meta = build_attention_metadata(
        [n for _, n in shapes], [c for c, _ in shapes], tables, BLOCK_SIZE
    )
    num_tokens = sum(n for _, n in shapes)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    query = 3 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    freed = [
        [poisoned if (i + 1) * BLOCK_SIZE <= c - window + 1 else b for i, b in enumerate(t)]
        for (c, _), t in zip(shapes, tables, strict=True)
    ]
    assert freed != tables  # some block is out of every query's window
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    poisoned_k[poisoned] = float("nan")
    poisoned_v[poisoned] = float("nan")
    freed_meta = build_attention_metadata(
        [n for _, n in shapes], [c for c, _ in shapes], freed, BLOCK_SIZE
    )
    return query, (k_cache, v_cache, meta), (poisoned_k, poisoned_v, freed_meta)


def _expected(query, k_cache, v_cache, meta, scale, window, softcap=None):
    windowed = reference.paged_attention(
        query, k_cache, v_cache, meta, scale, softcap=softcap, window=window
    )
    full = reference.paged_attention(query, k_cache, v_cache, meta, scale, softcap=softcap)
    assert not torch.allclose(windowed, full, atol=1e-3)  # the window matters in this case
    return windowed


def _to(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("group, window, softcap", [(1, 5, None), (3, 11, None), (2, 9, 2.0)])
def test_prefill_kernel_windows_like_the_reference(group, window, softcap):
    shapes = [(0, 11), (13, 6), (20, 1), (26, 9)]
    query, (k_cache, v_cache, meta), (pk, pv, freed) = _case(shapes, 2 * group, 2, window)
    scale = 0.3
    expected = _expected(query, k_cache, v_cache, meta, scale, window, softcap)
    # The reference gathers only blocks the window reaches, so it reads no poisoned block either.
    got_reference = reference.paged_attention(
        query, pk, pv, freed, scale, softcap=softcap, window=window
    )
    torch.testing.assert_close(got_reference, expected, atol=1e-5, rtol=1e-5)
    out = paged_prefill_attention(
        *_to(query, pk, pv, freed.block_tables, freed.query_start_loc, freed.seq_lens),
        scale,
        11,
        softcap=softcap,
        window=window,
    ).cpu()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits, window, softcap", [(1, 5, None), (3, 12, None), (2, 7, 2.0)])
def test_decode_kernel_windows_like_the_reference(num_splits, window, softcap):
    query, (k_cache, v_cache, meta), (pk, pv, freed) = _case(
        [(9, 1), (30, 1), (0, 1), (40, 1)], 6, 2, window
    )
    scale = 0.3
    expected = _expected(query, k_cache, v_cache, meta, scale, window, softcap)
    # The reference gathers each decode's blocks from the first its window reaches.
    got_reference = reference.paged_attention(
        query, pk, pv, freed, scale, softcap=softcap, window=window
    )
    torch.testing.assert_close(got_reference, expected, atol=1e-5, rtol=1e-5)
    out = paged_decode_attention(
        *_to(query, pk, pv, freed.block_tables, freed.seq_lens),
        scale,
        num_splits=num_splits,
        softcap=softcap,
        window=window,
    ).cpu()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_tiny_mistral_through_the_triton_backend_frees_blocks_and_matches_transformers(tmp_path):
    from services.engine.llm_engine import LLMEngine
    from services.scheduler.block_manager import NULL_BLOCK
    from shared.sampling import SamplingParams
    from tests.factories import engine_config, random_prompts
    from tests.support.tiny_families import VOCAB, hf_greedy, make_tiny_family

    model_dir = make_tiny_family(tmp_path, "mistral", seed=7)  # window 24 on every layer
    prompts = random_prompts([3, 34], VOCAB, seed=17)
    config = engine_config(
        model_dir, block_size=4, max_num_batched_tokens=16, attention_backend="triton"
    )
    engine = LLMEngine(config)
    freed = []

    def on_step(e):
        e.scheduler.block_manager.check()
        freed.append(sum(t.count(NULL_BLOCK) for t in e.scheduler.block_manager.tables.values()))

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, on_step=on_step)]
    assert max(freed) >= 3  # the kernels ran with table entries freed behind the window
    assert ours == [hf_greedy(model_dir, tuple(p), 6) for p in prompts]
