"""Triton causal paged attention for one or more query tokens per sequence, via block tables."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_math import cdiv, next_power_of_2
from kernels.triton_configs import launch_options
from kernels.triton_decode import native_dot_dtypes
from kernels.triton_softcap import softcap_scores

# Rows of one query tile: query tokens x the query heads of one GQA group. Folding the group into
# the tile makes each K/V tile serve every head that shares it, so K/V is read once per group.
_TILE_ROWS = 64
# Tile rows are sized for heads of up to this many dims: a query tile's fp32 accumulator,
# [rows, BLOCK_D], lives in registers, and 64 rows of 256 dims at 4 warps took all 255 and
# spilled 104-136 bytes per thread at sm_80 (24 at sm_90 with Triton 3.6), while 64 of 128
# spill nothing. Wider heads get proportionally fewer rows (scripts/compile_for_gpu.py).
_TILE_HEAD_DIM = 128
# Keys per inner step. Keys are gathered slot by slot through the block table, so this need not
# equal the cache block size; 32 keeps tl.dot legal (>= 16) even for 8-token cache blocks.
_BLOCK_N = 32
_LOG2E = 1.4426950408889634


# The table's width changes from step to step: no variants compiled for it.
@triton.jit(do_not_specialize=["max_blocks", "stride_bts"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    o_ptr,  # [num_tokens, num_heads, head_dim]
    bt_ptr,  # [num_seqs, max_blocks]
    qsl_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    softcap,  # softcap * log2(e): the cap in the same base-2 units, used when SOFTCAP
    window,  # int: a query at p sees keys at positions > p - window when WINDOW
    max_blocks,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bts,
    stride_btb,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # power of two >= GROUP (tl.arange); BLOCK_Q * it >= 16 if USE_DOT
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    USE_DOT: tl.constexpr,  # every tile dim >= 16 (a GPU's dots); else multiply and reduce
    DOT_PRECISION: tl.constexpr,
    # 16-bit Q/K/V into the dots as they are (fp32 accumulation; P rounded to their type for
    # P @ V, as flash attention does): the full tensor-core rate, half the registers.
    NATIVE_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,  # cap the scores (Gemma 2); off: no extra work
    WINDOW: tl.constexpr,  # sliding window: start at the tile's first visible key
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    # Scalar loads below index with seq < num_seqs (the grid's first dim): always in bounds.
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = (tl.load(qsl_ptr + seq + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # The grid is sized by the longest query; shorter sequences have idle tiles.
    if q_block * BLOCK_Q >= q_len:
        return

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # query row within the sequence
    member = rows % GROUP_PAD  # head within the GQA group
    head = kv_head * GROUP + member
    row_ok = (tok < q_len) & (member < GROUP)
    q_pos = seq_len - q_len + tok  # absolute position of each query token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_ptrs = (
        q_ptr
        + (q_start + tok)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + d[None, :] * stride_qd
    )
    q_mask = row_ok[:, None] & d_ok[None, :]
    # Folding the scale into Q costs one multiply per query element instead of one per score.
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32) * qk_scale  # 16-bit Q keeps its values: scaled after the dot

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)

    # Causality: the tile's last query sees keys up to its own position, nothing beyond.
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_Q)
    kv_start = 0
    if WINDOW:
        # The tile's first query sees keys from its position - window + 1; earlier blocks may
        # have been freed and reused, so they are never read.
        kv_start = tl.maximum(seq_len - q_len + q_block * BLOCK_Q - window + 1, 0)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        col = n // BLOCK_SIZE
        # The column bound only guards a table shorter than seq_len claims (bad input).
        n_ok = (n < kv_end) & (col < max_blocks)
        block = tl.load(bt_row + col * stride_btb, mask=n_ok, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        k_off = block * stride_kb + offset * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        v_off = block * stride_vb + offset * stride_vs + kv_head * stride_vh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        # K is loaded transposed, [BLOCK_D, BLOCK_N], so Q @ K needs no tl.trans.
        k = tl.load(
            k_ptr + k_off[None, :] + d[:, None] * stride_kd,
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        v = tl.load(v_ptr + v_off[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if not NATIVE_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)

        if NATIVE_DOT:
            s = tl.dot(q, k) * qk_scale
        elif USE_DOT:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        else:
            s = tl.sum(q[:, :, None] * k[None, :, :], axis=1)
        if SOFTCAP:  # before the mask: tanh would turn -inf into -softcap
            s = softcap_scores(s, softcap)
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet (only padding rows) keep m = -inf; shifting by 0 there
        # keeps exp2 at 0 instead of exp2(-inf - -inf) = NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Every real query row sees key 0, so l_i > 0 there; the guard only spares padding rows.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = (
        o_ptr
        + (q_start + tok)[:, None] * stride_ot
        + head[:, None] * stride_oh
        + d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_mask)


def prefill_shape(device: torch.device) -> tuple[int, int, dict[str, int]]:
    """(tile rows, keys per inner step, the other launch options) on `device`: a GPU's config
    file may set "tile_rows" and "block_n" (benchmarks/triton_config_sweep.py chooses them);
    otherwise _TILE_ROWS and _BLOCK_N."""
    options = launch_options("prefill", device)
    return options.pop("tile_rows", _TILE_ROWS), options.pop("block_n", _BLOCK_N), options


def largest_query_tile(tile_rows: int, group_pad: int, head_dim: int) -> int:
    """The most query tokens (BLOCK_Q) one program holds: tile_rows rows, fewer for heads wider
    than _TILE_HEAD_DIM, over the GQA group's padded heads."""
    block_d = next_power_of_2(head_dim)
    rows = tile_rows * _TILE_HEAD_DIM // max(block_d, _TILE_HEAD_DIM)
    return max(1, rows // group_pad)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], step's K stored
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], step's V stored
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: seq i owns rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor,  # [num_seqs] int: context length after this step
    scale: float,
    max_query_len: int,  # host-side: sizes the grid
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    window: int | None = None,  # sliding window: a query at p sees keys at positions > p - window
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's query rows over its cached context.

    Query row j of sequence i sits at position seq_lens[i] - q_len + j and sees keys at positions
    <= its own. Grid: (num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads); each program holds
    BLOCK_Q query tokens x all query heads of one kv head, and walks the context in BLOCK_N-key
    steps, gathering keys through the block table, with an fp32 online softmax.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    tile_rows, block_n, options = prefill_shape(query.device)
    # A decode-only batch gets a 1-token tile rather than a mostly idle 64-row one.
    block_q = min(
        largest_query_tile(tile_rows, group_pad, head_dim), next_power_of_2(max_query_len)
    )
    block_d = next_power_of_2(head_dim)
    # GPUs' tl.dot needs every dim >= 16. A tile of fewer rows (short queries: a speculative
    # verify, a chunk's tail) is padded to 16 with idle group members, as the decode kernel
    # pads its group: masked rows cost no memory traffic, while the broadcast form's
    # [rows, BLOCK_D, BLOCK_N] product lives in registers (all 255 of them, or up to 5.8 KB
    # per thread on the stack, at sm_90: scripts/compile_for_gpu.py).
    use_dot = block_n >= 16 and block_d >= 16
    if use_dot and block_q * group_pad < 16:
        group_pad = 16 // block_q
    # 16-bit data goes into the dots as it is (fp32 accumulation); fp32 inputs would lose 13
    # mantissa bits in tf32, hence full-precision dots there (and for 16-bit data the
    # interpreter cannot dot: kernels.triton_decode.native_dot_dtypes).
    native_dot = use_dot and query.dtype in native_dot_dtypes() and k_cache.dtype == query.dtype
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    grid = (num_seqs, cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        # cap * tanh(x / cap) scales with its argument: capping base-2 scores by cap * log2(e)
        # equals capping the natural scores by cap, then converting.
        (softcap or 1.0) * _LOG2E,
        window or 0,
        block_tables.shape[1],
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        USE_DOT=use_dot,
        DOT_PRECISION=precision,
        NATIVE_DOT=native_dot,
        SOFTCAP=bool(softcap),
        WINDOW=bool(window),
        **options,
    )
    return out
