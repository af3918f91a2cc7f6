"""Per-step attention metadata: built once on the host, read by every layer's attention call."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


def int64_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
    """[len(values)] (or [rows, len]) int64 host tensor from Python ints: through numpy,
    which converts a list several times faster than torch.tensor does (at batch 256 that is
    tens of microseconds per step, docs/benchmarks.md)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting: on a GPU through pinned memory with a
    non-blocking copy (a plain .to() would wait for all work queued on the stream, so a step
    prepared while the previous one runs would wait for it). Elsewhere a plain copy."""
    if device.type != "cuda":
        return tensor.to(device)
    # torch's caching host allocator keeps the pinned block until the copy has run.
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)


@dataclass
class PrefillSpan:
    """One sequence with several query tokens (a prompt, a prompt chunk or a recompute), or a
    one-token chunk read from a mirror."""

    query_start: int  # first row of this sequence in the flat batch
    query_end: int  # one past its last row
    start_pos: int  # tokens already cached before this step; 0 means no cached context
    blocks: torch.Tensor  # [num_blocks] int64 block ids holding the whole context
    # [num_layers, 2, num_kv_heads, capacity, head_dim]: the context's K/V laid out for attention,
    # valid up to start_pos; this step's are written into it (services/executor/context_mirror.py).
    # None: the context is gathered from the blocks.
    mirror: torch.Tensor | None = None
    # The causal mask per query-head group, built by the first layer that asks and reused by
    # the rest: the same for every layer, and each of its small ops counts on a CPU at verify
    # and chunk sizes.
    masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def causal_mask(self, group: int, device: torch.device) -> torch.Tensor:
        """[group * q_len, ctx] bool, True where a query sees a key: query i sits at position
        start_pos + i and sees keys at positions <= that; the rows repeat for each of the
        `group` query heads folded into a KV head's rows (reference._grouped_attention)."""
        mask = self.masks.get(group)
        if mask is None:
            q_len = self.query_end - self.query_start
            positions = torch.arange(self.start_pos + q_len, device=device)
            mask = positions[None, :] <= positions[:q_len, None] + self.start_pos
            mask = self.masks[group] = mask.repeat(group, 1)
        return mask


@dataclass
class ReferenceViews:
    """What the PyTorch reference needs besides the block tables: single-token (decode)
    sequences batched into one padded call, the others looped over. Built once per step."""

    decode_rows: torch.Tensor  # [num_decodes] int64 row of each decode sequence's query
    # Whole blocks are gathered (one 2-D copy per block beats one per slot); padding masked.
    decode_blocks: torch.Tensor  # [num_decodes, max_decode_blocks] int64 block ids, padded
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_decode_blocks * block_size] bool
    prefills: list[PrefillSpan]
    mirrored: bool = False  # some span has a mirror: attention calls then name their layer


@dataclass
class MixedSplit:
    """A mixed step's sequences for the Triton backend: the one-token ones (decodes) go to the
    decode kernel, the others to the prefill kernel, whose tiles of 64 query rows a single row
    would mostly leave idle (with GQA a decode row fills a few of them). Built on the host,
    where the query lengths are known, and uploaded in one copy."""

    decode_seqs: torch.Tensor  # [num_decodes] int64 index of each decode sequence
    decode_rows: torch.Tensor  # [num_decodes] int64 its query row
    prefill_seqs: torch.Tensor  # [num_prefills] int64 index of each multi-token sequence
    prefill_rows: torch.Tensor  # [prefill_tokens] int64 their query rows, in order
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int64 over prefill_rows
    prefill_max_query_len: int


@dataclass
class AttentionMetadata:
    """A flat varlen batch: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 past each table
    block_size: int
    max_query_len: int  # host-side: 1 means a pure decode batch; sizes the prefill grid
    positions: torch.Tensor  # [num_tokens] int64 position of each new token in its sequence
    reference: ReferenceViews | None  # only when the reference backend runs the step
    # [num_tokens] int64: the length of the sequence each token was planned in, where it is more
    # than the token's position + 1 (prompt chunks, recomputes; ScheduledSeq.rope_len); longrope
    # picks its rotary table by it. None: every token's own position + 1.
    rope_lens: torch.Tensor | None = None
    # Steps with decodes and multi-token sequences, for the Triton backend; None otherwise.
    mixed: MixedSplit | None = None
    # [num_tokens] int64 the sequence (row of block_tables) of each token: the CPU row kernels
    # read a token's context through it (kernels/cpu_rows.py).
    token_seqs: torch.Tensor | None = None


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
    max_blocks = max(max((len(t) for t in block_tables), default=0), 1)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
    table = table.view(num_seqs, max_blocks).to(device)
    return metadata_from_table(
        query_lens, start_positions, table, block_size, reference_views=reference_views
    )


def metadata_from_table(
    query_lens: list[int],
    start_positions: list[int],
    table: torch.Tensor,  # [num_seqs, max_blocks] int64 on the target device, any padding
    block_size: int,
    reference_views: bool = True,
    rope_lens: list[int] | None = None,  # [num_seqs] ScheduledSeq.rope_len, 0 where None
    mirrors: list[torch.Tensor | None] | None = None,  # [num_seqs] PrefillSpan.mirror
) -> AttentionMetadata:
    """The same, from block tables already on the device: one small host-to-device copy."""
    device = table.device
    num_seqs = len(query_lens)
    num_tokens = sum(query_lens)
    lens = host_to_device(int64_tensor([query_lens, start_positions]), device)
    lens_q, starts = lens[0], lens[1]  # [num_seqs] each
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens_q, 0, out=qsl[1:])
    # The slot of every new token, from its sequence's table: [num_tokens]. output_size keeps
    # repeat_interleave from asking the device how long its result is.
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), lens_q, output_size=num_tokens
    )
    position = starts[seq_of_token] + (
        torch.arange(num_tokens, device=device) - qsl[:-1][seq_of_token]
    )
    slot_mapping = table[seq_of_token, position // block_size] * block_size + position % block_size
    seq_lens = starts + lens_q
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=table,
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        positions=position,
        reference=(
            _reference_views(
                query_lens, start_positions, table, qsl, seq_lens, block_size, device, mirrors
            )
            if reference_views
            else None
        ),
        rope_lens=(
            None
            if rope_lens is None
            else host_to_device(torch.tensor(rope_lens), device)[seq_of_token]
        ),
        mixed=None if reference_views else mixed_split(query_lens, device),
        token_seqs=seq_of_token,
    )


@functools.lru_cache(maxsize=64)
def arange_on(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64 0..n-1 on `device`, made once per size: decode steps need a few per step, and
    each fresh one is an op (a launch on a GPU). Read-only: callers must not write to it."""
    return torch.arange(n, device=device)


def decode_metadata(
    start_positions: list[int],
    starts: torch.Tensor,  # [num_seqs] int64 the same on the device
    table: torch.Tensor,  # [num_seqs, max_blocks] int64 on the device, any padding
    block_size: int,
    reference_views: bool = True,
) -> AttentionMetadata:
    """metadata_from_table for a step of one new token per sequence (most decode steps): the
    token rows are the sequences, so there is nothing to expand, and the positions come with
    the caller's single upload."""
    device = table.device
    num_seqs = len(start_positions)
    seq_index = arange_on(num_seqs, device)
    slot_mapping = table[seq_index, starts // block_size] * block_size + starts % block_size
    seq_lens = starts + 1
    reference = None
    if reference_views:
        max_blocks = -(-(max(start_positions, default=0) + 1) // block_size)
        positions = arange_on(max_blocks * block_size, device)
        reference = ReferenceViews(
            decode_rows=seq_index,
            decode_blocks=table[:, :max_blocks],
            decode_mask=(positions[None, :] < seq_lens[:, None])[:, None, None, :],
            prefills=[],
        )
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=arange_on(num_seqs + 1, device),
        seq_lens=seq_lens,
        block_tables=table,
        block_size=block_size,
        max_query_len=1 if num_seqs else 0,
        positions=starts,
        reference=reference,
        token_seqs=seq_index,
    )


def mixed_split(query_lens: list[int], device: torch.device) -> MixedSplit | None:
    """The decode/prefill partition of a step with both kinds of sequences; None otherwise."""
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    prefills = [i for i, n in enumerate(query_lens) if n > 1]
    if not decodes or not prefills:
        return None
    starts = list(itertools.accumulate(query_lens, initial=0))
    head = torch.tensor([*decodes, *(starts[i] for i in decodes), *prefills], dtype=torch.int64)
    # A loop per sequence, not per token: a prefill chunk may be thousands of rows.
    prefill_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in prefills])
    prefill_lens = (query_lens[i] for i in prefills)
    prefill_starts = torch.tensor(list(itertools.accumulate(prefill_lens, initial=0)))
    flat = host_to_device(torch.cat([head, prefill_rows, prefill_starts]), device)
    sizes = [len(decodes), len(decodes), len(prefills), len(prefill_rows), len(prefills) + 1]
    return MixedSplit(*torch.split(flat, sizes), prefill_max_query_len=max(query_lens))


def _reference_views(
    query_lens: list[int],
    start_positions: list[int],
    table: torch.Tensor,  # [num_seqs, max_blocks] int64
    qsl: torch.Tensor,  # [num_seqs + 1] int64
    lens: torch.Tensor,  # [num_seqs] int64
    block_size: int,
    device: torch.device | str,
    mirrors: list[torch.Tensor | None] | None,
) -> ReferenceViews:
    decode_seq_idx, prefills = [], []
    row = 0  # host copies of qsl and lens: no per-sequence reads of device values
    max_decode_len = 0
    for i, q_len in enumerate(query_lens):
        seq_len = start_positions[i] + q_len
        mirror = None if mirrors is None else mirrors[i]
        if q_len == 1 and mirror is None:
            decode_seq_idx.append(i)
            max_decode_len = max(max_decode_len, seq_len)
        else:
            blocks = table[i, : -(-seq_len // block_size)]
            prefills.append(PrefillSpan(row, row + q_len, start_positions[i], blocks, mirror))
        row += q_len
    decode_idx = host_to_device(int64_tensor(decode_seq_idx), device)
    if decode_seq_idx:
        max_decode_blocks = -(-max_decode_len // block_size)
        decode_blocks = table[decode_idx, :max_decode_blocks]
        positions = torch.arange(max_decode_blocks * block_size, device=device)
        decode_mask = positions[None, :] < lens[decode_idx][:, None]
    else:
        decode_blocks = torch.zeros((0, 0), dtype=torch.int64, device=device)
        decode_mask = torch.zeros((0, 0), dtype=torch.bool, device=device)
    return ReferenceViews(
        decode_rows=qsl[decode_idx],
        decode_blocks=decode_blocks,
        decode_mask=decode_mask[:, None, None, :],
        prefills=prefills,
        mirrored=any(span.mirror is not None for span in prefills),
    )
