"""Soft-capped scores (Gemma 2) in the Triton decode and prefill kernels equal the reference."""

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
SOFTCAP = 2.0
BLOCK_SIZE = 8


def _case(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int):
    """Random cache, tables and queries for (cached, new) token counts per sequence; this
    step's K/V stored by the reference."""
    gen = torch.Generator().manual_seed(len(shapes) * 10 + num_heads)
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in shapes) + 4
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))] for c, n in shapes]
    meta = build_attention_metadata(
        [n for _, n in shapes], [c for c, _ in shapes], tables, BLOCK_SIZE
    )
    num_tokens = sum(n for _, n in shapes)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    # Scores of several units: the cap at 2 changes them a lot.
    query = 3 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    return query, k_cache, v_cache, meta


def _expected(query, k_cache, v_cache, meta, scale):
    capped = reference.paged_attention(query, k_cache, v_cache, meta, scale, softcap=SOFTCAP)
    plain = reference.paged_attention(query, k_cache, v_cache, meta, scale)
    assert not torch.allclose(capped, plain, atol=1e-3)  # the cap matters in this case
    return capped


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_kernel_caps_scores_like_the_reference(group):
    query, k_cache, v_cache, meta = _case([(0, 11), (13, 6), (20, 1)], 2 * group, 2, 16)
    scale = 0.3
    out = paged_prefill_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        meta.block_tables.to(DEVICE),
        meta.query_start_loc.to(DEVICE),
        meta.seq_lens.to(DEVICE),
        scale,
        11,
        softcap=SOFTCAP,
    ).cpu()
    expected = _expected(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_kernel_caps_scores_like_the_reference(num_splits):
    query, k_cache, v_cache, meta = _case([(9, 1), (30, 1), (0, 1)], 6, 2, 16)
    scale = 0.3
    out = paged_decode_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        meta.block_tables.to(DEVICE),
        meta.seq_lens.to(DEVICE),
        scale,
        num_splits=num_splits,
        softcap=SOFTCAP,
    ).cpu()
    expected = _expected(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_tiny_gemma2_through_the_triton_backend_matches_transformers(tmp_path):
    from services.engine.llm_engine import LLMEngine
    from shared.sampling import SamplingParams
    from tests.factories import engine_config, random_prompts
    from tests.support.tiny_families import VOCAB, hf_greedy, make_tiny_family

    model_dir = make_tiny_family(tmp_path, "gemma2", seed=7)
    prompts = random_prompts([1, 9, 20], VOCAB, seed=16)
    config = engine_config(
        model_dir, block_size=8, max_num_batched_tokens=16, attention_backend="triton"
    )
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in LLMEngine(config).generate(prompts, greedy)]
    assert ours == [hf_greedy(model_dir, tuple(p), 6) for p in prompts]
