"""Turn a plan's scheduled sequences into the flat tensors of one forward pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata, host_to_device, metadata_from_table
from shared.protocol import ScheduledSeq


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64, sequences back to back
    positions: torch.Tensor  # [num_tokens] int64
    attention: AttentionMetadata
    # [num_sampling_seqs] int64: flat row of the last token of each sampling seq, plan order;
    # logits row i therefore belongs to the i-th sampling seq of the plan.
    logits_rows: torch.Tensor


def build_inputs(
    seqs: list[ScheduledSeq],
    table: torch.Tensor,  # [len(seqs), max_blocks] int64 block tables on the device, same order
    block_size: int,
    reference_views: bool,
) -> ModelInputs:
    """Host work: concatenate the token ids, list the lengths; the rest is built on the device."""
    device = table.device
    input_ids = list(itertools.chain.from_iterable(s.token_ids for s in seqs))
    attention = metadata_from_table(
        [len(s.token_ids) for s in seqs],
        [s.start_pos for s in seqs],
        table,
        block_size,
        reference_views,
    )
    sampling = torch.tensor([i for i, s in enumerate(seqs) if s.sample], dtype=torch.int64)
    return ModelInputs(
        input_ids=host_to_device(torch.tensor(input_ids, dtype=torch.int64), device),
        positions=attention.positions,
        attention=attention,
        logits_rows=attention.query_start_loc[1:][host_to_device(sampling, device)] - 1,
    )
