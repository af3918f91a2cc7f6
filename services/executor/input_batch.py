"""Turn a plan's scheduled sequences into the flat tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata, build_attention_metadata
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
    tables: list[list[int]],  # block table of each of seqs, same order
    block_size: int,
    device: torch.device | str,
    reference_views: bool,
) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    last_rows: list[int] = []
    for seq in seqs:
        input_ids.extend(seq.token_ids)
        positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
        if seq.sample:
            last_rows.append(len(input_ids) - 1)
    attention = build_attention_metadata(
        [len(s.token_ids) for s in seqs],
        [s.start_pos for s in seqs],
        tables,
        block_size,
        device,
        reference_views,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attention=attention,
        logits_rows=torch.tensor(last_rows, dtype=torch.int64, device=device),
    )
