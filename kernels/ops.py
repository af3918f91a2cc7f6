"""Picks the implementation of every paged op for a run: the PyTorch reference or Triton."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    """One backend's paged ops; signatures are those of kernels/reference.py."""

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]


def resolve_backend(name: str, device: torch.device) -> str:
    """auto means Triton on CUDA and the reference elsewhere; triton off CUDA needs the
    interpreter, which is slow and meant for tests."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton attention backend needs a CUDA device; on a CPU it runs only interpreted "
            "(set TRITON_INTERPRET=1 before starting: very slow, meant for tests), "
            "so use --attention-backend torch or auto here"
        )
    return name


def select_ops(name: str, device: torch.device) -> KernelOps:
    backend = resolve_backend(name, device)
    if backend == "torch":
        from kernels import reference

        return KernelOps(
            "torch",
            reference.store_kv,
            reference.paged_attention,
            reference.copy_blocks,
            reference.swap_blocks,
        )
    from kernels import triton_ops

    return KernelOps(
        "triton",
        triton_ops.store_kv,
        triton_ops.paged_attention,
        triton_ops.copy_blocks,
        triton_ops.swap_blocks,
    )
