"""Fused mixture-of-experts on CUDA: every (token, expert) pair sorted by expert and padded to
whole row blocks, then one grouped-GEMM Triton launch per projection, each row block reading
its one expert's weight (the design of vLLM's fused_moe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_math import cdiv

# Rows of pairs per program: 16 keeps tl.dot legal on GPUs (every dim >= 16).
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def align_by_expert(
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # pairs [rows] int32, block_experts [rows / BLOCK_M] int32
    """Pair indices (token * top_k + slot) grouped by expert, each expert's group padded to a
    multiple of BLOCK_M with the out-of-range index num_pairs; the expert of each row block, -1
    for blocks past the last group. Sizes follow from the shapes alone (no host sync), so a
    CUDA graph can capture it."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    # Every expert with pairs pads at most BLOCK_M - 1 rows, and at most num_pairs experts have any.
    rows = -(-(num_pairs + min(num_experts, num_pairs) * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on its max
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    pairs[padded_end[experts] - padded[experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, BLOCK_M, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_starts < padded_end[-1], block_experts, -1)
    return pairs, block_experts.to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_rows_of_a, K]: tokens (first projection) or pairs (second)
    b_ptr,  # [num_experts, N, K]: stacked expert weights
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] fp32 routing weights (read only when MUL_WEIGHT)
    pairs_ptr,  # [rows] int32, padded with num_pairs
    block_experts_ptr,  # [rows / BLOCK_M] int32, -1: nothing to do
    num_pairs,
    N,
    K,
    stride_a,
    stride_be,
    stride_bn,
    stride_c,
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when a holds tokens, 1 when it holds pairs
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + offs_m)
        valid = pairs < num_pairs
        a_rows = pairs // PAIRS_PER_A_ROW
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_a + kk[None, :],
                mask=valid[:, None] & (kk[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            b = tl.load(
                b_base + offs_n[None, :] * stride_bn + kk[:, None],
                mask=(offs_n[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]: the expert's rows, transposed
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
            acc = acc * w[:, None]
        tl.store(
            c_ptr + pairs[:, None] * stride_c + offs_n[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=valid[:, None] & (offs_n[None, :] < N),
        )


def _grouped_gemm(a, b, c, weights, pairs, block_experts, pairs_per_a_row: int) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (block_experts.shape[0], cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        c if weights is None else weights,
        pairs,
        block_experts,
        c.shape[0],
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [num_experts, 2 * width, hidden]
    down: torch.Tensor,  # [num_experts, hidden, width]
    weights: torch.Tensor,  # [num_tokens, top_k] fp32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    act,
) -> torch.Tensor:  # [num_tokens, hidden]
    """What models.moe.grouped_experts computes, as two grouped GEMMs over expert-sorted pairs:
    gate_up for every pair, the activation, then down scaled by each pair's routing weight;
    each token's top_k rows summed last."""
    num_tokens, top_k = ids.shape
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    pairs, block_experts = align_by_expert(ids, gate_up.shape[0])
    num_pairs = num_tokens * top_k
    inter = torch.empty(num_pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, inter, None, pairs, block_experts, top_k)
    gate, up = inter.chunk(2, dim=-1)
    h = (act(gate) * up).contiguous()  # [num_pairs, width]
    out = torch.empty(num_pairs, down.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    _grouped_gemm(h, down, out, flat_weights, pairs, block_experts, 1)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
