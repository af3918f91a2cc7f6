"""The Triton paged decode kernel against the PyTorch reference (kernels.reference).

Without CUDA the kernels run under the Triton interpreter (numpy, slow), so every CPU case is
tiny: at most 4 sequences and 80 tokens of context.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: @triton.jit reads it at decoration time, and
    # triton.language's own helpers (tl.sum, tl.cdiv, ...) are decorated on import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.metadata import build_attention_metadata  # noqa: E402
from kernels.reference import paged_attention  # noqa: E402
from kernels.triton_decode import (  # noqa: E402
    MAX_AUTO_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    tile_blocks,
    tile_config,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
TOLERANCE = {  # (rtol, atol) against an fp32 reference
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def _make_case(
    seq_lens,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype=torch.float32,
    seed=0,
    device=DEVICE,
    extra_blocks=5,
):
    """Random decode batch with permuted, non-contiguous block tables. The last sequence
    shares its first block with the first earlier one that fills a block, as forked samples do
    after copy-on-write; `shared` says whether that happened."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + extra_blocks  # spare blocks no table points at
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    donors = [i for i, n in enumerate(seq_lens[:-1]) if n > block_size]
    shared = bool(donors) and seq_lens[-1] > block_size
    if shared:
        tables[-1][0] = tables[donors[0]][0]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = build_attention_metadata(
        [1] * len(seq_lens), [n - 1 for n in seq_lens], tables, block_size
    )
    to = dict(device=device)
    return query.to(**to), k_cache.to(**to), v_cache.to(**to), meta, shared


def _reference(query, k_cache, v_cache, meta):
    """kernels.reference.paged_attention in fp32 on CPU, whatever the inputs' dtype."""
    f32 = [t.float().cpu() for t in (query, k_cache, v_cache)]
    return paged_attention(*f32, meta, query.shape[-1] ** -0.5)


def _run(query, k_cache, v_cache, meta, num_splits=None, table_dtype=torch.int64):
    device = query.device
    return paged_decode_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables.to(device=device, dtype=table_dtype),
        meta.seq_lens.to(device),
        query.shape[-1] ** -0.5,
        num_splits=num_splits,
    )


def _assert_close(out, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_fp32_single_pass_and_split_match_reference(block_size, num_kv_heads):
    # Length 1, an exact multiple of the block size, partial last blocks, up to 80 tokens.
    seq_lens = [1, 2 * block_size, block_size + 3, 80]
    query, k_cache, v_cache, meta, shared = _make_case(seq_lens, block_size, 4, num_kv_heads, 64)
    assert shared  # sequences 1 and 3 read one physical block
    expected = _reference(query, k_cache, v_cache, meta)

    single = _run(query, k_cache, v_cache, meta, num_splits=1)
    _assert_close(single, expected, torch.float32)
    # Three partitions of the table: sequence 0 leaves two of them empty.
    split = _run(query, k_cache, v_cache, meta, num_splits=3)
    _assert_close(split, expected, torch.float32)
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_size, num_splits", [(16, 1), (16, 3), (8, 2)])
def test_fp16_matches_reference(block_size, num_splits):
    seq_lens = [5, 32, 47, 80]
    query, k_cache, v_cache, meta, _ = _make_case(seq_lens, block_size, 4, 2, 64, torch.float16)
    out = _run(query, k_cache, v_cache, meta, num_splits)
    _assert_close(out, _reference(query, k_cache, v_cache, meta), torch.float16)


@pytest.mark.parametrize("block_size", [8, 16])
def test_bf16_matches_reference(block_size):
    # The interpreter stores bf16 as raw uint16 and converts on .to(): the kernel upcasts every
    # load at once and casts back only to store, so bf16 works there too.
    seq_lens = [9, 40, 64]
    query, k_cache, v_cache, meta, _ = _make_case(seq_lens, block_size, 4, 1, 64, torch.bfloat16)
    out = _run(query, k_cache, v_cache, meta, num_splits=2)
    _assert_close(out, _reference(query, k_cache, v_cache, meta), torch.bfloat16)


def test_head_dim_128():
    query, k_cache, v_cache, meta, _ = _make_case([3, 33, 64], 16, 4, 2, 128, seed=1)
    expected = _reference(query, k_cache, v_cache, meta)
    _assert_close(_run(query, k_cache, v_cache, meta, 1), expected, torch.float32)
    _assert_close(_run(query, k_cache, v_cache, meta, 3), expected, torch.float32)


def test_head_dim_not_a_power_of_two():
    # 48 is padded to 64 inside the kernel; the padding lanes are masked on load and store.
    query, k_cache, v_cache, meta, _ = _make_case([7, 40], 8, 4, 2, 48, seed=2)
    out = _run(query, k_cache, v_cache, meta, 2)
    _assert_close(out, _reference(query, k_cache, v_cache, meta), torch.float32)


def test_tile_config_picks_dot_or_broadcast():
    # (group, head_dim, block_size) -> (GROUP_PAD, HEAD_DIM_PAD, USE_DOT)
    assert tile_config(4, 64, 16) == (16, 64, True)  # group padded up to the MMA minimum
    assert tile_config(16, 128, 32) == (16, 128, True)
    assert tile_config(32, 48, 16) == (32, 64, True)
    assert tile_config(3, 64, 8) == (4, 64, False)  # block under 16: broadcast + tl.sum
    assert tile_config(1, 8, 32) == (1, 8, False)  # head_dim under 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_group_of_16(dtype):
    # 16 query heads per kv head: the dot path with an unpadded group tile.
    query, k_cache, v_cache, meta, _ = _make_case([1, 21, 48], 16, 16, 1, 64, dtype, seed=3)
    expected = _reference(query, k_cache, v_cache, meta)
    _assert_close(_run(query, k_cache, v_cache, meta, 1), expected, dtype)
    _assert_close(_run(query, k_cache, v_cache, meta, 2), expected, dtype)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_tiny_block_sizes(block_size):
    query, k_cache, v_cache, meta, _ = _make_case([1, 4, 11], block_size, 4, 2, 64, seed=4)
    expected = _reference(query, k_cache, v_cache, meta)
    _assert_close(_run(query, k_cache, v_cache, meta, 1), expected, torch.float32)
    _assert_close(_run(query, k_cache, v_cache, meta, 3), expected, torch.float32)


def test_int32_tables_and_extreme_split_counts():
    query, k_cache, v_cache, meta, _ = _make_case([2, 30, 64], 8, 4, 2, 64, seed=5)
    expected = _reference(query, k_cache, v_cache, meta)
    max_blocks = meta.block_tables.shape[1]  # 8
    # One block per split, more splits than blocks (clamped), and the automatic choice.
    for num_splits in (max_blocks, 50, None):
        out = _run(query, k_cache, v_cache, meta, num_splits, table_dtype=torch.int32)
        _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("tile_tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tiles_of_several_blocks_match_reference(tile_tokens, num_splits):
    # Several cache blocks per loop iteration: a tile that runs past a split's last block, past
    # the sequence's last block or over a partial last block reads nothing there.
    query, k_cache, v_cache, meta, _ = _make_case([1, 17, 50, 80], 16, 4, 2, 16, seed=9)
    expected = _reference(query, k_cache, v_cache, meta)
    out = paged_decode_attention(
        query, k_cache, v_cache, meta.block_tables.to(query.device),
        meta.seq_lens.to(query.device), query.shape[-1] ** -0.5,
        num_splits=num_splits, tile_tokens=tile_tokens,
    )  # fmt: skip
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("tile_tokens", [32, 64])
def test_tiles_of_several_blocks_keep_the_window(tile_tokens):
    # A window's first block starts the first tile; blocks wholly before it (NaN here, as a
    # freed and reused block may hold) are never read, whatever the tile.
    query, k_cache, v_cache, meta, _ = _make_case([70, 33, 5], 16, 4, 2, 16, seed=10)
    window = 20
    scale = query.shape[-1] ** -0.5
    f32 = [t.float().cpu() for t in (query, k_cache, v_cache)]
    expected = paged_attention(*f32, meta, scale, window=window)
    for i, n in enumerate(meta.seq_lens.tolist()):
        for b in range(max(n - window, 0) // 16):  # wholly before the window
            block = int(meta.block_tables[i, b])
            k_cache[block], v_cache[block] = float("nan"), float("nan")
    for num_splits in (1, 2):
        out = paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables.to(query.device),
            meta.seq_lens.to(query.device), scale, num_splits=num_splits, window=window,
            tile_tokens=tile_tokens,
        )  # fmt: skip
        _assert_close(out, expected, torch.float32)


def test_tile_blocks_rule():
    assert tile_blocks(64, 16, use_dot=True) == 4
    assert tile_blocks(64, 32, use_dot=True) == 2
    assert tile_blocks(16, 16, use_dot=True) == 1
    assert tile_blocks(8, 16, use_dot=True) == 1
    assert tile_blocks(64, 8, use_dot=False) == 1  # the broadcast form keeps one block


def test_splits_share_out_each_sequence_not_the_table_width():
    # CUDA graphs capture block tables at max_model_len's width. A short context in such a
    # table must still have its blocks shared out over the splits: each split of each sequence
    # sees keys (its partial sum > 0), and the result is the reference's.
    query, k_cache, v_cache, meta, _ = _make_case([40, 64, 9], 8, 4, 2, 32, seed=7)
    expected = _reference(query, k_cache, v_cache, meta)
    padding = torch.full((3, 200), -1, dtype=meta.block_tables.dtype)  # unused table entries
    wide = torch.cat([meta.block_tables, padding], dim=1).to(query.device)
    partials = []
    out = paged_decode_attention(
        query, k_cache, v_cache, wide, meta.seq_lens.to(query.device), query.shape[-1] ** -0.5,
        num_splits=2, partials=partials,
    )  # fmt: skip
    _assert_close(out, expected, torch.float32)
    part_sum = partials[1].cpu()  # [num_seqs, num_heads, num_splits]
    assert part_sum.shape == (3, 4, 2)
    assert bool((part_sum > 0).all()), part_sum  # 9 tokens: 2 blocks of 8, one per split


def test_slots_past_seq_len_are_never_read():
    # Unwritten slots of a last, partial block may hold anything; NaN must not leak out.
    seq_lens = [5, 19]
    query, k_cache, v_cache, meta, _ = _make_case(seq_lens, 8, 4, 2, 64, seed=6)
    expected = _reference(query, k_cache, v_cache, meta)
    for i, n in enumerate(seq_lens):
        last = int(meta.block_tables[i, (n - 1) // 8])
        k_cache[last, n % 8 :] = float("nan")
        v_cache[last, n % 8 :] = float("inf")
    out = _run(query, k_cache, v_cache, meta, 2)
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_zero_length_sequence_gives_zeros(num_splits):
    # Nothing visible: the kernel writes 0 (SDPA would give NaN), and its neighbour is intact.
    query, k_cache, v_cache, meta, _ = _make_case([1, 12], 8, 4, 2, 64, seed=8)
    expected = _reference(query, k_cache, v_cache, meta)
    seq_lens = torch.tensor([0, 12], device=query.device)
    out = paged_decode_attention(
        query, k_cache, v_cache, meta.block_tables.to(query.device), seq_lens, 0.125, num_splits
    )
    assert torch.count_nonzero(out[0]) == 0
    _assert_close(out[1:], expected[1:], torch.float32)


def test_choose_num_splits_rule():
    # Short contexts: one pass. Then one split per 256 tokens, capped.
    assert choose_num_splits(4, 8, max_blocks=16, block_size=16) == 1
    assert choose_num_splits(4, 8, max_blocks=17, block_size=16) == 2
    assert choose_num_splits(4, 8, max_blocks=64, block_size=16) == 4
    assert choose_num_splits(1, 8, max_blocks=10_000, block_size=16) == MAX_AUTO_SPLITS
    assert choose_num_splits(1, 1, max_blocks=1, block_size=1) == 1
    # A batch that already launches enough programs is not split.
    assert choose_num_splits(64, 8, max_blocks=10_000, block_size=16) == 1


def test_rejects_mismatched_shapes():
    query, k_cache, v_cache, meta, _ = _make_case([3], 8, 4, 2, 64)
    with pytest.raises(ValueError):
        _run(query[:, :3], k_cache, v_cache, meta)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError):
        _run(query, k_cache, v_cache, meta, num_splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1: compiled kernels only")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(32, 8, 128, 16), (32, 2, 128, 16), (8, 8, 64, 32), (16, 4, 64, 8)],
)
def test_gpu_medium_batch(dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1, 3000, (12,), generator=gen).tolist() + [1, 4096]
    query, k_cache, v_cache, meta, _ = _make_case(
        seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, device="cuda"
    )
    expected = _reference(query, k_cache, v_cache, meta)
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else TOLERANCE[dtype]
    for num_splits in (1, 5, None):
        out = _run(query, k_cache, v_cache, meta, num_splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float().cpu(), expected, rtol=rtol, atol=atol)


def test_per_step_integers_compile_no_variants():
    # The block table's width (and the split count) change from step to step; a kernel that
    # specialised on them would compile new variants inside timed runs. The declaration is only
    # visible on compiled (not interpreted) kernels: read it in a process without the
    # interpreter (nothing runs on a device there).
    code = (
        "from kernels.triton_decode import _paged_decode_kernel, _merge_splits_kernel\n"
        "from kernels.triton_prefill import _prefill_kernel\n"
        "for k in (_paged_decode_kernel, _merge_splits_kernel, _prefill_kernel):\n"
        "    assert set(k.do_not_specialize) <= set(k.arg_names), k.do_not_specialize\n"
        "    print(k.fn.__name__, *k.do_not_specialize)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    declared = {line.split()[0]: set(line.split()[1:]) for line in done.stdout.splitlines()}
    assert declared == {
        "_paged_decode_kernel": {"max_blocks", "stride_bt_seq"},
        "_merge_splits_kernel": {"num_splits"},
        "_prefill_kernel": {"max_blocks", "stride_bts"},
    }
