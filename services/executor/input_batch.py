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
    logits_rows: (
        torch.Tensor
    )  # [num_sampling_seqs] int64: flat row of each sampling seq's last token
    logits_row_of: dict[int, int]  # seq_id -> row in the logits tensor


def build_inputs(
    seqs: list[ScheduledSeq],
    tables: dict[int, list[int]],
    block_size: int,
    device: torch.device | str,
) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    last_rows: list[int] = []
    row_of: dict[int, int] = {}
    for seq in seqs:
        input_ids.extend(seq.token_ids)
        positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
        if seq.sample:
            row_of[seq.seq_id] = len(last_rows)
            last_rows.append(len(input_ids) - 1)
    attention = build_attention_metadata(
        [len(s.token_ids) for s in seqs],
        [s.start_pos for s in seqs],
        [tables[s.seq_id] for s in seqs],
        block_size,
        device,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attention=attention,
        logits_rows=torch.tensor(last_rows, dtype=torch.int64, device=device),
        logits_row_of=row_of,
    )
