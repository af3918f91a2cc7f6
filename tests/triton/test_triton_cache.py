"""The Triton cache ops (store_kv, copy_blocks) and the batched swap against kernels.reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import reference, triton_cache  # noqa: E402

# The kernels run here; the reference always runs on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, 2, 64, 16),
        (torch.float16, 4, 64, 8),
        (torch.bfloat16, 1, 128, 32),
        (torch.float32, 3, 24, 8),  # neither dim a power of two: masked tails
    ],
)
def test_store_kv_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    num_blocks, num_tokens = 6, 11
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    key = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=3)
    value = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=4)
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # a padding token: written nowhere
    slots[7] = -1
    keep = slots >= 0
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    # The reference has no notion of padding: it writes only the real tokens.
    reference.store_kv(key[keep], value[keep], expected_k, expected_v, slots[keep])

    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    triton_cache.store_kv(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))

    assert torch.equal(k_dev.cpu(), expected_k) and torch.equal(v_dev.cpu(), expected_v)


def test_store_kv_from_fused_qkv_view():
    # K and V as slices of one QKV projection: strided rows, written exactly all the same.
    k_cache = _randn(4, 8, 2, 64, seed=6)
    v_cache = _randn(4, 8, 2, 64, seed=7)
    qkv = _randn(5, 8, 64, seed=8)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([9, 0, 31, 17, 4])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)

    triton_cache.store_kv(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_blocks_matches_reference(dtype):
    cache = _randn(3, 2, 10, 8, 2, 64, dtype=dtype, seed=9)
    pairs = [(0, 7), (4, 2), (4, 9), (1, 8)]  # one source fanned out to two destinations
    expected = cache.clone()
    reference.copy_blocks(expected, pairs)

    dev = cache.to(DEVICE)
    triton_cache.copy_blocks(dev, pairs)

    assert torch.equal(dev.cpu(), expected)


def test_copy_blocks_chained_pairs_match_reference():
    # A destination that is also a source: the reference reads all sources first.
    cache = _randn(2, 2, 6, 4, 1, 16, seed=10)
    pairs = [(0, 1), (1, 2), (3, 3)]
    expected = cache.clone()
    reference.copy_blocks(expected, pairs)

    triton_cache.copy_blocks(cache, pairs)

    assert torch.equal(cache, expected)


def test_copy_blocks_no_pairs_is_a_no_op():
    cache = _randn(1, 2, 3, 4, 1, 16, seed=11)
    before = cache.clone()
    triton_cache.copy_blocks(cache, [])
    assert torch.equal(cache, before)


def test_swap_blocks_cpu_to_cpu_matches_reference():
    src = _randn(3, 2, 6, 8, 2, 16, seed=12)
    dst = _randn(3, 2, 4, 8, 2, 16, seed=13)
    pairs = [(2, 3), (5, 0), (0, 1)]
    expected = dst.clone()
    reference.swap_blocks(src, expected, pairs)

    triton_cache.swap_blocks(src, dst, pairs)

    assert torch.equal(dst, expected)
    triton_cache.swap_blocks(src, dst, [])
    assert torch.equal(dst, expected)


def test_block_lists_reach_the_device_without_a_pageable_upload(monkeypatch):
    # torch.tensor(list, device=cuda) uploads from pageable memory, which waits for the step in
    # flight (every copy-on-write and swap-in would stall the overlap). The index tensors are
    # built on the host and handed to host_to_device (pinned, non-blocking on a GPU).
    made_on_a_device, uploads = [], []
    tensor, upload = torch.tensor, triton_cache.host_to_device

    def watched_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            made_on_a_device.append(kwargs["device"])
        return tensor(*args, **kwargs)

    def watched_upload(t, device):
        uploads.append(tuple(t.shape))
        return upload(t, device)

    monkeypatch.setattr(torch, "tensor", watched_tensor)
    monkeypatch.setattr(triton_cache, "host_to_device", watched_upload)
    cache = _randn(2, 2, 6, 4, 1, 16, seed=14)
    triton_cache.copy_blocks(cache.to(DEVICE), [(0, 4), (1, 5)])
    triton_cache.swap_blocks(_randn(2, 2, 3, 4, 1, 16, seed=15), cache, [(0, 2), (2, 3)])
    assert made_on_a_device == []
    assert uploads == [(2, 2), (2,), (2,)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swap_blocks_cuda_round_trip(dtype):
    device_pool = _randn(4, 2, 12, 16, 8, 128, dtype=dtype, seed=14).cuda()
    host_pool = _randn(4, 2, 6, 16, 8, 128, dtype=dtype, seed=15)
    out_pairs = [(7, 0), (2, 5), (11, 3)]
    expected_host = host_pool.clone()
    reference.swap_blocks(device_pool.cpu(), expected_host, out_pairs)

    triton_cache.swap_blocks(device_pool, host_pool, out_pairs)  # swap out: CUDA -> CPU
    assert torch.equal(host_pool, expected_host)

    in_pairs = [(0, 1), (5, 9), (3, 4)]
    expected_dev = device_pool.cpu()
    reference.swap_blocks(host_pool, expected_dev, in_pairs)
    triton_cache.swap_blocks(host_pool, device_pool, in_pairs)  # swap in: CPU -> CUDA
    torch.cuda.synchronize()
    assert torch.equal(device_pool.cpu(), expected_dev)
