"""Triton paged-attention decode kernel (one query token per sequence), after vLLM v1/v2.

The kernel reads K/V straight out of the paged cache through the block table: no gather into a
dense copy. One program handles one (sequence, kv head[, split]) and all the query heads of that
GQA group at once, so each K/V block is loaded once per group, not once per query head.

With num_splits > 1 (vLLM's paged_attention_v2, "flash-decoding") each program covers a
contiguous range of the sequence's blocks and writes an unnormalised partial output plus its
running max and sum to fp32 scratch; a second small kernel merges the partitions. That keeps
the GPU busy when there are few (sequence, kv head) pairs and long contexts.

Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a
token at logical position p of a sequence lives at block block_tables[seq, p // block_size],
offset p % block_size. All arithmetic is fp32 whatever the storage dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch_math import cdiv, next_power_of_2
from kernels.triton_configs import launch_options
from kernels.triton_softcap import softcap_scores

# choose_num_splits: aim for at least this many context tokens per partition (vLLM v2 uses 512;
# a partition must be long enough that its fixed cost, and the merge, stay small) ...
PARTITION_TOKENS = 256
# ... and never more partitions than this (the merge kernel loads all of them at once).
MAX_AUTO_SPLITS = 16
# Once the batch alone launches this many (sequence, kv head) programs the GPU is already busy
# and splitting only adds the merge; vLLM's v1/v2 switch uses a similar occupancy test.
ENOUGH_PROGRAMS = 256
# Context tokens the decode kernel reads per loop iteration (several cache blocks at once, for
# loads in flight) when its dots run on tensor cores; a GPU's config file may set another
# ("tile_tokens", chosen by benchmarks/triton_config_sweep.py).
TILE_TOKENS = 64


# The table's width changes from step to step: specialising on it (== 1, divisible by 16)
# would compile new variants inside timed runs.
@triton.jit(do_not_specialize=["max_blocks", "stride_bt_seq"])
def _paged_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim], last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
    block_tables_ptr,  # [num_seqs, max_blocks] int32/int64
    seq_lens_ptr,  # [num_seqs] int32/int64
    out_ptr,  # [num_seqs, num_heads, head_dim] contiguous: written unless SPLIT
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32: written when SPLIT
    part_max_ptr,  # [num_seqs, num_heads, num_splits] fp32 running max of the scores
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] fp32 sum of exp(score - max)
    scale,  # float: softmax scale applied to q.k
    softcap,  # float: scores become softcap * tanh(scores / softcap) when SOFTCAP
    window,  # int: keys at positions >= seq_len - window are visible when WINDOW
    num_heads,  # int
    num_cache_blocks,  # int: k_cache.shape[0], to mask out-of-range block ids
    max_blocks,  # int: block_tables.shape[1]
    stride_q_seq,
    stride_q_head,
    stride_c_block,  # k_cache and v_cache share strides (checked on the host)
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # power of two >= GROUP (tl.arange), >= 16 if USE_DOT
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # cache block size, a power of two
    SPLIT: tl.constexpr,  # num_splits > 1: write partials, not the final output
    USE_DOT: tl.constexpr,  # tl.dot (all dims >= 16 on a GPU), else multiply + tl.sum
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 data (16-bit operands ignore it)
    # 16-bit Q/K/V into the dots as they are (fp32 accumulation; P rounded to their type for
    # P @ V, as flash attention does): the full tensor-core rate, half the registers.
    NATIVE_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,  # cap the scores (Gemma 2); off: no extra work
    WINDOW: tl.constexpr,  # sliding window: skip the blocks before it, mask the rest
    TILE_BLOCKS: tl.constexpr,  # cache blocks per loop iteration (a power of two)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    offs_g = tl.arange(0, GROUP_PAD)  # query head within the group
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # query head h reads kv head h // GROUP, as in HF/SDPA

    # grid dim 0 == num_seqs, so always in bounds; int32 keeps the loop bounds one type
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # Clamp to the table width so a seq_len the table cannot hold never reads past a row.
    num_blocks = tl.minimum(tl.cdiv(seq_len, BLOCK_SIZE), max_blocks)
    first_pos = 0  # the first key the query (at seq_len - 1) sees
    first_block = 0
    if WINDOW:
        first_pos = tl.maximum(seq_len - window, 0)
        # Blocks wholly before the window are never read: they may have been freed and reused.
        # The splits share out the blocks from the window's first on, not the whole table.
        first_block = first_pos // BLOCK_SIZE
    # The splits share out this sequence's own blocks, not the table's width: a table captured
    # at max_model_len (CUDA graphs) would otherwise put a short context in the first split
    # alone, and one program would do all of its work.
    blocks_per_split = tl.cdiv(tl.maximum(num_blocks - first_block, 0), num_splits)
    start_block = first_block + split * blocks_per_split
    end_block = tl.minimum(start_block + blocks_per_split, num_blocks)

    q_offs = seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    qd_mask = g_mask[:, None] & d_mask[None, :]
    # [GROUP_PAD, HEAD_DIM_PAD]; padded heads/dims are 0 and their results are never stored.
    q = tl.load(q_ptr + q_offs, mask=qd_mask, other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    # Online softmax state per query head. Every tile the loop visits starts with a block that
    # holds at least one visible key, so m_i is finite after the first tile and
    # exp(m_i - m_new) never sees (-inf) - (-inf).
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    # TILE_BLOCKS cache blocks per iteration: their ids are loaded as one vector and their K/V
    # rows as one [TILE, HEAD_DIM_PAD] gather, so several blocks' loads are in flight at once
    # instead of one 16-token block behind each dependent block-id load.
    offs_n = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)  # token within the tile
    slot = offs_n % BLOCK_SIZE
    for b0 in range(start_block, end_block, TILE_BLOCKS):
        b = b0 + offs_n // BLOCK_SIZE  # [TILE] the table entry of each token's block
        in_range = b < end_block  # a tile past this split's last block reads nothing
        # int64 before multiplying by the block stride: block_id * stride overflows int32 on
        # caches above 2**31 elements.
        block_id = tl.load(bt_row + b, mask=in_range, other=0).to(tl.int64)
        block_ok = (block_id >= 0) & (block_id < num_cache_blocks)
        pos = b * BLOCK_SIZE + slot  # logical positions of the tile's slots
        visible = (pos < seq_len) & (pos >= first_pos) & in_range
        # A bad block id reads nothing (its slots score 0 against a zero V, as before).
        t_mask = visible & block_ok
        kv_offs = (
            block_id[:, None] * stride_c_block
            + slot[:, None] * stride_c_slot
            + kv_head * stride_c_head
            + offs_d[None, :]
        )
        kv_mask = t_mask[:, None] & d_mask[None, :]
        # [TILE, HEAD_DIM_PAD]. Slots past seq_len load as 0: the cache there may hold stale
        # values or even NaN, and 0 * NaN would poison the P @ V sum.
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if not NATIVE_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)

        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = s * scale  # [GROUP_PAD, TILE]
        if SOFTCAP:  # before the mask: tanh would turn -inf into -softcap
            s = softcap_scores(s, softcap)
        s = tl.where(visible[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])  # masked slots: exp(-inf) = 0
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if not SPLIT:
        # l_i == 0 only for seq_len == 0 (nothing visible): write 0 rather than 0 / 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offs = (seq * num_heads + heads)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        # An empty split (its range starts past this sequence's blocks) writes max -inf,
        # sum 0 and a zero accumulator, which the merge weighs by exp(-inf) = 0.
        row = (seq * num_heads + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        p_offs = row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_out_ptr + p_offs, acc, mask=qd_mask)


@triton.jit(do_not_specialize=["num_splits"])  # varies by step; one compiled variant
def _merge_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim] contiguous, dtype of the query
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32 unnormalised partials
    part_max_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] fp32
    num_heads,  # int
    num_splits,  # int
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # a power of two >= num_splits
):
    """out = sum_s exp(m_s - M) * acc_s / sum_s exp(m_s - M) * l_s, M = max_s m_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    row = (seq * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + row, mask=s_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    # All splits empty only when seq_len == 0; keep exp() away from (-inf) - (-inf).
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)  # [SPLITS_PAD]; empty and padding splits weigh 0
    total = tl.sum(l_s * w, axis=0)

    acc_offs = row[:, None] * HEAD_DIM + offs_d[None, :]
    acc_mask = s_mask[:, None] & d_mask[None, :]
    acc = tl.load(part_out_ptr + acc_offs, mask=acc_mask, other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o_offs = (seq * num_heads + head) * HEAD_DIM + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int) -> int:
    """Split-K partitions for a decode batch, from host-side shapes only (no device sync).

    1 when the batch alone gives ENOUGH_PROGRAMS (sequence, kv head) programs; otherwise
    ceil(max_blocks * block_size / PARTITION_TOKENS) capped at MAX_AUTO_SPLITS, i.e. at least
    256 tokens of the longest possible context per partition (16 blocks at block_size 16), so
    contexts of up to 256 tokens use a single pass.
    """
    if num_seqs * num_kv_heads >= ENOUGH_PROGRAMS:
        return 1
    return max(1, min(cdiv(max_blocks * block_size, PARTITION_TOKENS), MAX_AUTO_SPLITS))


# Whether this module's kernels are interpreted: @triton.jit reads TRITON_INTERPRET when it
# decorates them, at import, so it is read once here too (not on every launch).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def native_dot_dtypes() -> tuple[torch.dtype, ...]:
    """The 16-bit types the dots take as they are. bf16 only when compiled: Triton's interpreter
    keeps bf16 as raw uint16 and would multiply the bit patterns (its bf16 runs upcast, and the
    `gpu` tests check the native path)."""
    if _INTERPRETED:
        return (torch.float16,)
    return (torch.float16, torch.bfloat16)


def tile_config(group: int, head_dim: int, block_size: int) -> tuple[int, int, bool]:
    """(GROUP_PAD, HEAD_DIM_PAD, USE_DOT) for a GQA group size, head_dim and block_size.

    tl.dot lowers to tensor-core MMAs, which work on tiles >= 16 in every dim. The cache fixes two
    of them (block_size and head_dim); the group dim is only rows of Q, so when those allow a
    dot the group is padded up to 16, as vLLM's Triton attention pads its query tile: padded
    rows are masked loads (no memory traffic) and MMAs on them are cheaper than the broadcast
    form, whose [GROUP_PAD, BLOCK_SIZE, HEAD_DIM] product lives in registers (ptxas, sm_90,
    bf16, head_dim 128, block 16: group 8 broadcast takes 254 registers and spills at block
    32; the padded dot takes 92). Blocks under 16 slots use the broadcast multiply + tl.sum.
    """
    head_dim_pad = next_power_of_2(head_dim)
    use_dot = head_dim_pad >= 16 and block_size >= 16
    group_pad = next_power_of_2(group)
    if use_dot:
        group_pad = max(group_pad, 16)
    return group_pad, head_dim_pad, use_dot


def tile_blocks(tile_tokens: int, block_size: int, use_dot: bool) -> int:
    """Cache blocks per decode-loop iteration: tile_tokens' worth (a power of two), one when
    the broadcast form runs (its [GROUP_PAD, TILE, HEAD_DIM] product lives in registers)."""
    if not use_dot or tile_tokens <= block_size:
        return 1
    return next_power_of_2(tile_tokens // block_size)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64, padded past each table
    seq_lens: torch.Tensor,  # [num_seqs] int: keys 0..seq_len-1 visible (query is the last)
    scale: float,
    num_splits: int | None = None,  # split-K partitions; None: choose_num_splits
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    window: int | None = None,  # sliding window: keys at positions >= seq_len - window visible
    partials: list | None = None,  # tests: receives (part_max, part_sum) of a split launch
    tile_tokens: int | None = None,  # tokens per loop iteration; None: the GPU's config
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], dtype of query
    """Decode attention of one query token per sequence over its paged K/V context.

    Matches kernels.reference.paged_attention on a decode-only batch. block_size must be a
    power of two; head_dim may be anything (padded to a power of two inside the kernel).
    num_splits is clamped to max_blocks, or with a window to the blocks it spans (more
    partitions than blocks would all be empty). Each sequence's visible blocks are shared out
    evenly over the splits, whatever the table's width.
    A sequence with seq_len 0 gets a zero output.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_cache_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if kv_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of shape {tuple(k_cache.shape)}"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.numel() != num_seqs:
        raise ValueError("block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs]")
    if k_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim must be contiguous")  # never copy a cache
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    max_blocks = block_tables.shape[1]
    if num_seqs == 0 or max_blocks == 0:
        return out.zero_()
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()

    # Blocks one sequence's query reads: with a window, at most the ceil(window / block) + 1 it
    # spans, wherever in the table they lie.
    span = min(max_blocks, cdiv(window, block_size) + 1) if window else max_blocks
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span, block_size)
    num_splits = min(num_splits, span)

    group = num_heads // num_kv_heads
    group_pad, head_dim_pad, use_dot = tile_config(group, head_dim, block_size)
    # 16-bit data goes into the dots as it is (fp32 accumulation); fp32 data needs "ieee" to
    # keep fp32 accuracy.
    native_dot = use_dot and query.dtype in native_dot_dtypes() and k_cache.dtype == query.dtype
    dot_precision = "ieee"

    if num_splits == 1:
        part_out = part_max = part_sum = out  # unused placeholders: the kernel never touches them
    else:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)

    options = launch_options("decode", query.device)
    configured = options.pop("tile_tokens", TILE_TOKENS)  # never passed on as a launch option
    tile_tokens = configured if tile_tokens is None else tile_tokens
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_max,
        part_sum,
        scale,
        softcap or 1.0,
        window or 0,
        num_heads,
        num_cache_blocks,
        max_blocks,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1,
        USE_DOT=use_dot,
        DOT_PRECISION=dot_precision,
        NATIVE_DOT=native_dot,
        SOFTCAP=bool(softcap),
        WINDOW=bool(window),
        TILE_BLOCKS=tile_blocks(tile_tokens, block_size, use_dot),
        **options,
    )
    if num_splits > 1:
        if partials is not None:
            partials.extend((part_max, part_sum))
        _merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            # At least the automatic choice's ceiling, so every automatic count shares one
            # compiled merge (a constexpr per power of two would compile up to four).
            SPLITS_PAD=max(MAX_AUTO_SPLITS, next_power_of_2(num_splits)),
        )
    return out
