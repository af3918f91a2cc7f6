"""Per-step attention metadata: built once on the host, read by every layer's attention call."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One sequence with several query tokens (a prompt, a prompt chunk or a recompute)."""

    query_start: int  # first row of this sequence in the flat batch
    query_end: int  # one past its last row
    start_pos: int  # tokens already cached before this step; 0 means no cached context
    blocks: torch.Tensor  # [num_blocks] int64 block ids holding the whole context


@dataclass
class ReferenceViews:
    """What the PyTorch reference needs besides the block tables: single-token (decode)
    sequences batched into one padded call, the others looped over. Built once per step."""

    decode_rows: torch.Tensor  # [num_decodes] int64 row of each decode sequence's query
    # Whole blocks are gathered (one 2-D copy per block beats one per slot); padding masked.
    decode_blocks: torch.Tensor  # [num_decodes, max_decode_blocks] int64 block ids, padded
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_decode_blocks * block_size] bool
    prefills: list[PrefillSpan]


@dataclass
class AttentionMetadata:
    """A flat varlen batch: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 past each table
    block_size: int
    max_query_len: int  # host-side: 1 means a pure decode batch; sizes the prefill grid
    reference: ReferenceViews | None  # only when the reference backend runs the step


def build_attention_metadata(
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    reference_views: bool = True,
) -> AttentionMetadata:
    """Metadata for sequences that each compute query_lens[i] tokens from start_positions[i]."""
    num_seqs = len(query_lens)
    seq_lens = [s + q for s, q in zip(start_positions, query_lens)]
    max_blocks = max(max((len(t) for t in block_tables), default=0), 1)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
    table = table.view(num_seqs, max_blocks)
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)

    # The slot of every new token, from its sequence's table: [num_tokens]
    lens_q = torch.tensor(query_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens_q)
    first_row = torch.repeat_interleave(
        torch.tensor(query_start_loc[:-1], dtype=torch.int64), lens_q
    )
    position = torch.tensor(start_positions, dtype=torch.int64)[seq_of_token] + (
        torch.arange(query_start_loc[-1]) - first_row
    )
    slot_mapping = table[seq_of_token, position // block_size] * block_size + position % block_size

    qsl = torch.tensor(query_start_loc, dtype=torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=lens.to(device),
        block_tables=table.to(device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        reference=(
            _reference_views(query_lens, start_positions, table, qsl, lens, block_size, device)
            if reference_views
            else None
        ),
    )


def _reference_views(
    query_lens: list[int],
    start_positions: list[int],
    table: torch.Tensor,  # [num_seqs, max_blocks] int64
    qsl: torch.Tensor,  # [num_seqs + 1] int64
    lens: torch.Tensor,  # [num_seqs] int64
    block_size: int,
    device: torch.device | str,
) -> ReferenceViews:
    decode_seq_idx, prefills = [], []
    for i, q_len in enumerate(query_lens):
        if q_len == 1:
            decode_seq_idx.append(i)
        else:
            num_blocks = -(-int(lens[i]) // block_size)
            start, end = int(qsl[i]), int(qsl[i + 1])
            blocks = table[i, :num_blocks].to(device)
            prefills.append(PrefillSpan(start, end, start_positions[i], blocks))
    decode_idx = torch.tensor(decode_seq_idx, dtype=torch.int64)
    if decode_seq_idx:
        max_decode_blocks = -(-int(lens[decode_idx].max()) // block_size)
        decode_blocks = table[decode_idx, :max_decode_blocks]
        positions = torch.arange(max_decode_blocks * block_size)
        decode_mask = positions[None, :] < lens[decode_idx][:, None]
    else:
        decode_blocks = torch.zeros((0, 0), dtype=torch.int64)
        decode_mask = torch.zeros((0, 0), dtype=torch.bool)
    return ReferenceViews(
        decode_rows=qsl[decode_idx].to(device),
        decode_blocks=decode_blocks.to(device),
        decode_mask=decode_mask[:, None, None, :].to(device),
        prefills=prefills,
    )
