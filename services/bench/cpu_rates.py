"""This CPU's sustained fp32 GEMM rate and copy bandwidth, measured now (ceilings for a model)."""

from __future__ import annotations

import time

import torch


def matmul_gflops(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """Sustained fp32 GEMM rate for [m, k] @ [k, n]."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - start) / 1e9


def copy_bandwidth(num_bytes: int = 256 << 20, seconds: float = 1.0) -> float:
    """Bytes/s of a host-memory copy of num_bytes (read + write counted)."""
    src = torch.empty(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dst.copy_(src)
        count += 1
    return 2 * num_bytes * count / (time.perf_counter() - start)  # read + write
