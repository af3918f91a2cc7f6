"""Tensor parallelism: which slice of the model a rank holds, and the collectives between ranks.

Megatron-style, as the paper's section 4.6: attention heads and KV heads split across ranks
(each rank's KV pool holds its heads of every block, so one block table serves all ranks);
q/k/v, gate and up projections split by output (column-parallel); o and down projections split
by input (row-parallel) and summed with one all-reduce each; embedding and LM head split by
vocabulary. When a model has fewer KV heads than ranks, ranks that share a KV head each hold a
copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """This rank's place among `size` ranks; size 1 means the whole model, no collectives."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group (None: the default group)

    @property
    def is_driver(self) -> bool:
        """Rank 0 talks to the scheduler, samples and answers; the others only compute."""
        return self.rank == 0

    def span(self, total: int) -> tuple[int, int]:
        """[start, end) of an evenly divisible dimension of size total."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def kv_span(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this rank's query heads read (one head, replicated, if kv < ranks)."""
        if num_kv_heads >= self.size:
            return self.span(num_kv_heads)
        q_start, _ = self.span(num_heads)
        head = q_start // (num_heads // num_kv_heads)
        return head, head + 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def check_divisible(spec: Any, size: int) -> None:
    """Refuse at start-up a model that cannot be split evenly over `size` ranks."""
    problems = []
    if spec.num_heads % size:
        problems.append(f"{spec.num_heads} attention heads")
    if spec.num_kv_heads % size and size % spec.num_kv_heads:
        problems.append(f"{spec.num_kv_heads} KV heads")
    if spec.intermediate_size % size:
        problems.append(f"an MLP width of {spec.intermediate_size}")
    moe = getattr(spec, "moe", None)
    if moe is not None and moe.intermediate_size % size:  # each expert split as a dense MLP
        problems.append(f"an expert MLP width of {moe.intermediate_size}")
    if spec.vocab_size % size:
        problems.append(f"a vocabulary of {spec.vocab_size}")
    if problems:
        raise ValueError(
            f"tensor-parallel size {size} does not divide {', '.join(problems)} of this model"
        )


# A rank that dies mid-step surfaces as an error, not a hang, within this time.
GROUP_TIMEOUT = timedelta(seconds=120)


def open_store(master_addr: str, port: int, size: int, *, is_master: bool) -> dist.TCPStore:
    """The ranks' rendezvous; the master binds it (port 0: one the kernel picks, see `.port`)."""
    return dist.TCPStore(master_addr, port, size, is_master, GROUP_TIMEOUT, wait_for_workers=False)


def init_group(
    rank: int,
    size: int,
    master_addr: str,
    master_port: int,
    device: str,
    store: dist.TCPStore | None = None,  # rank 0's, bound already; the others connect to it
) -> Shard:
    """Join the ranks (NCCL on CUDA, gloo on the CPU) and return this rank's Shard."""
    backend = "nccl" if device == "cuda" else "gloo"
    if store is None:
        store = open_store(master_addr, master_port, size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    return Shard(rank, size)


def broadcast_bytes(shard: Shard, payload: bytes | None, device: torch.device) -> bytes:
    """Rank 0's payload to every rank (length first, then the bytes); b"" means stop."""
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    length = length.to(device)
    dist.broadcast(length, src=0, group=shard.group)
    n = int(length.item())
    if n == 0:
        return b""
    if shard.is_driver:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0, group=shard.group)
    return payload if shard.is_driver else bytes(data.cpu().numpy())
