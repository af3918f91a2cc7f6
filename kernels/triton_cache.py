"""Triton KV-cache writes and block copies, and the batched device<->host block swap."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.launch_math import cdiv, next_power_of_2
from kernels.metadata import host_to_device

# Elements of one cache block moved per copy_blocks program.
_COPY_CHUNK = 2048


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens]
    block_size,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)  # tok < num_tokens by the grid: in bounds
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # A negative slot marks a padding token: the mask drops its whole write. The slot is
    # broadcast before the compare: the interpreter turns scalar-bool & tensor-bool into int64.
    slot_tile = slot + tl.zeros([BLOCK_H, BLOCK_D], tl.int64)
    mask = (slot_tile >= 0) & (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)

    k = tl.load(
        key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(
        k_dst + h[:, None] * stride_kch + d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + h[:, None] * stride_vch + d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int: block_id * block_size + offset; < 0 skips
) -> None:
    """Write each token's K and V into its cache slot; one program per token, all kv heads."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # Slots are not bounds-checked on the device (that would cost a sync); the block manager
    # hands out slots inside the pool.
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [num_layers * 2, num_blocks, block_numel]
    pairs_ptr,  # [num_pairs, 2] int64: (src_block, dst_block)
    stride_plane,
    stride_block,
    block_numel,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    chunk = tl.program_id(2)
    # pair < num_pairs by the grid: both loads are in bounds.
    src = tl.load(pairs_ptr + pair * 2)
    dst = tl.load(pairs_ptr + pair * 2 + 1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    base = cache_ptr + plane * stride_plane
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


def copy_blocks(
    cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    pairs: list[tuple[int, int]],  # (src_block, dst_block)
) -> None:
    """Copy block src to dst in every layer, K and V: one launch for all pairs (copy-on-write)."""
    if not pairs:
        return
    num_layers, _, num_blocks = cache.shape[:3]
    block_numel = cache.shape[3:].numel()
    if cache.numel() == 0:
        return
    # The reference reads every source before writing any destination; parallel programs cannot
    # promise that when a destination is also a source (never so for copy-on-write, whose
    # destinations are fresh blocks). The kernel also addresses a block as plane + block index,
    # which needs each block to be one contiguous run and the layers evenly spaced (true of the
    # pool, one contiguous tensor). Anything else takes the reference path.
    srcs = {s for s, _ in pairs}
    flat_ok = cache[0, 0, 0].is_contiguous() and (
        num_layers == 1 or cache.stride(0) == 2 * cache.stride(1)
    )
    if any(d in srcs for _, d in pairs) or not flat_ok:
        reference.copy_blocks(cache, pairs)
        return
    # [num_layers * 2, num_blocks, block_numel], keeping the pool's outer strides
    planes = cache.as_strided(
        (num_layers * 2, num_blocks, block_numel),
        (cache.stride(1), cache.stride(2), 1),
    )
    # Through pinned memory: a pageable upload would wait for the step in flight.
    pair_tensor = host_to_device(torch.tensor(pairs, dtype=torch.int64), cache.device)
    chunk = min(_COPY_CHUNK, next_power_of_2(block_numel))
    grid = (len(pairs), num_layers * 2, cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        planes, pair_tensor, planes.stride(0), planes.stride(1), block_numel, CHUNK=chunk
    )


def swap_blocks(
    src_cache: torch.Tensor,  # [num_layers, 2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_layers, 2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    pairs: list[tuple[int, int]],  # (src_block, dst_block)
) -> None:
    """Move blocks between pools on different devices (swap out to / in from host memory).

    Not a Triton kernel: a kernel cannot address host memory. One block per copy would be
    num_layers * 2 * num_pairs small transfers; instead the source blocks are gathered into one
    contiguous staging tensor on the source device, cross the bus in a single transfer through
    pinned host memory (pageable memory would force a synchronous, bounced copy), and are
    scattered into the destination with one index_copy_.
    """
    if not pairs:
        return
    src_dev, dst_dev = src_cache.device, dst_cache.device
    # [num_pairs] each, through pinned memory where they go to a GPU (see copy_blocks)
    src_idx = host_to_device(torch.tensor([s for s, _ in pairs], dtype=torch.int64), src_dev)
    dst_idx = host_to_device(torch.tensor([d for _, d in pairs], dtype=torch.int64), dst_dev)
    staged_shape = (*src_cache.shape[:2], len(pairs), *src_cache.shape[3:])
    if src_dev.type == "cpu" and dst_dev.type == "cuda":
        # Gather straight into pinned memory (no extra host copy), then one async upload. The
        # device-side index_copy_ queues behind it on the stream, and the caching host allocator
        # keeps the pinned buffer alive until the upload has finished.
        pinned = torch.empty(staged_shape, dtype=src_cache.dtype, pin_memory=True)
        torch.index_select(src_cache, 2, src_idx, out=pinned)
        staged = pinned.to(dst_dev, non_blocking=True)
    else:
        # [num_layers, 2, num_pairs, block_size, num_kv_heads, head_dim], contiguous
        staged = src_cache.index_select(2, src_idx)
        if src_dev.type == "cuda" and dst_dev.type == "cpu":
            host = torch.empty(staged_shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            # The CPU index_copy_ below is outside CUDA's stream order: wait for the download.
            torch.cuda.current_stream(src_dev).synchronize()
            staged = host
        elif src_dev != dst_dev:
            staged = staged.to(dst_dev)
    dst_cache.index_copy_(2, dst_idx, staged.to(dst_cache.dtype))
