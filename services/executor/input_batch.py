"""Turn a plan's scheduled sequences into the flat tensors of one forward pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.metadata import (
    AttentionMetadata,
    arange_on,
    decode_metadata,
    host_to_device,
    int64_tensor,
    metadata_from_table,
)
from shared.protocol import ScheduledSeq


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64, sequences back to back
    positions: torch.Tensor  # [num_tokens] int64
    attention: AttentionMetadata
    # [num_logits_rows] int64: flat row of the last token of each sampling seq, plan order, and
    # for a speculating seq its last num_spec_tokens + 1 rows (one per verified position); the
    # logits rows follow the same order.
    logits_rows: torch.Tensor


def build_inputs(
    seqs: list[ScheduledSeq],
    table: torch.Tensor,  # [len(seqs), max_blocks] int64 block tables on the device, same order
    block_size: int,
    reference_views: bool,
    mirrors: list[torch.Tensor | None] | None = None,  # [len(seqs)] PrefillSpan.mirror
    ids_on_device: bool = False,  # one token each, all still on the device: written later
    one_token_each: bool | None = None,  # each entry one token, no rope_len; None: look
) -> ModelInputs:
    """Host work: concatenate the token ids, list the lengths; the rest is built on the device."""
    device = table.device
    if one_token_each is None:
        one_token_each = all(len(s.token_ids) == 1 and s.rope_len is None for s in seqs)
    if mirrors is None and one_token_each:
        return _one_token_each(seqs, table, block_size, reference_views, ids_on_device)
    input_ids = list(itertools.chain.from_iterable(s.token_ids for s in seqs))
    attention = metadata_from_table(
        [len(s.token_ids) for s in seqs],
        [s.start_pos for s in seqs],
        table,
        block_size,
        reference_views,
        # Only prompt chunks and recomputes carry one (step_plans.py): decode steps send none.
        [s.rope_len or 0 for s in seqs] if any(s.rope_len for s in seqs) else None,
        mirrors,
    )
    rows = []
    end = 0
    for s in seqs:
        end += len(s.token_ids)
        if s.sample:
            rows.extend(range(end - 1 - s.num_spec_tokens, end))
    return ModelInputs(
        input_ids=host_to_device(int64_tensor(input_ids), device),
        positions=attention.positions,
        attention=attention,
        logits_rows=host_to_device(int64_tensor(rows), device),
    )


def _one_token_each(
    seqs: list[ScheduledSeq],
    table: torch.Tensor,  # [len(seqs), max_blocks] int64 on the device
    block_size: int,
    reference_views: bool,
    ids_on_device: bool,
) -> ModelInputs:
    """build_inputs for a step of decodes alone (most steps): token ids and positions in one
    upload (positions alone when the ids are the previous step's samples, still on the
    device), the rows being the sequences themselves."""
    device = table.device
    starts = [s.start_pos for s in seqs]
    if ids_on_device:
        input_ids = torch.empty(len(seqs), dtype=torch.int64, device=device)
        positions = host_to_device(int64_tensor(starts), device)
    else:
        token_ids = [s.token_ids[0] for s in seqs]
        input_ids, positions = host_to_device(int64_tensor([token_ids, starts]), device)
    rows = [i for i, s in enumerate(seqs) if s.sample]
    if len(rows) < len(seqs):  # not every sequence samples: its own upload (rare)
        logits_rows = host_to_device(int64_tensor(rows), device)
    else:
        logits_rows = arange_on(len(seqs), device)
    attention = decode_metadata(starts, positions, table, block_size, reference_views)
    return ModelInputs(
        input_ids=input_ids,
        positions=attention.positions,
        attention=attention,
        logits_rows=logits_rows,
    )
