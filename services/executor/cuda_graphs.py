"""Decode steps replayed from CUDA graphs: one capture per bucketed batch size.

A decode step of a small model is hundreds of kernel launches and as many trips through Python;
replaying a captured graph issues them all at once. Graphs need fixed shapes and fixed
addresses, so every input of the forward pass lives in a static buffer sized for the largest
bucket: a step of n sequences fills the first n rows and pads up to the next bucket (1, 2, 4,
8, then multiples of 8 up to max_num_seqs) with rows that write nowhere (slot -1, which the
Triton store kernel skips) and attend to nothing (context length 0: a zero output). Only the
forward pass is captured; the LM head of the sampling rows and the sampler run eagerly after it.

With capture=False the same padded static-buffer path runs eagerly: that is how the CPU tests
check everything but the capture itself (Triton interpreted).
"""

from __future__ import annotations

import logging

import torch

from kernels.metadata import AttentionMetadata

log = logging.getLogger("pagedserve.executor")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (the last one max_num_seqs itself)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 8))
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        block_size: int,
        max_blocks_per_seq: int,
        max_num_seqs: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.capture = capture
        device = kv_cache.device
        size = self.buckets[-1]
        # The static inputs; a replay reads whatever they hold.
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def bucket(self, num_seqs: int) -> int | None:
        """The bucket a decode batch of num_seqs runs in, or None when it is too big."""
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            block_size=self.block_size,
            max_query_len=1,
            positions=self.positions[:b],
            reference=None,
        )

    def _forward(self, b: int) -> torch.Tensor:  # [b, hidden]
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, self._meta(b))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then fit in the memory pool the largest reserved.
        for b in reversed(self.buckets):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, allocators settle
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(b)
            self._graphs[b] = (graph, hidden)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,  # the step's own metadata: n one-token sequences
    ) -> torch.Tensor:  # [n, hidden]
        n = input_ids.shape[0]
        b = self.bucket(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # Padding rows: write nowhere, attend to nothing. Their token ids and positions are
        # whatever valid ones an earlier step left there (their outputs are dropped), and
        # columns past a row's length are never read.
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[n:b].fill_(0)
        if not self.capture:
            return self._forward(b)[:n]
        graph, hidden = self._graphs[b]
        graph.replay()
        return hidden[:n]
