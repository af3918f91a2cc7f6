"""Contiguous copies of the cached K/V of prompts computed chunk by chunk deep into their context.

On a CPU the reference attention gathers a prompt chunk's whole cached context from its blocks
every step and hands SDPA a head-strided view, which it copies again: at 7,800 tokens of
SmolLM2's context that is about 360 MB gathered plus as much re-laid out per step, whatever the
chunk's size, so a deep chunk of four tokens cost as much as three decode steps for the streams
waiting on it (`benchmarks/long_prompt_fairness.py`). A mirror keeps such a sequence's K/V in the
layout attention reads ([layer, k|v, kv_head, position, head_dim]), started with the prompt's
first chunk when the prompt's length says it will be that deep (else filled once from the blocks
at its first deep chunk) and then only appended to by each chunk (kernels/reference.py), so a
step reads the context once, in place. The blocks stay the truth: a mirror is rebuilt from them
whenever it could disagree.
"""

from __future__ import annotations

import torch

from shared.protocol import ScheduledSeq

# Below this much cached context the gather is cheap and a mirror not worth its memory.
MIN_CONTEXT = 256


class ContextMirrors:
    """The mirrors of the sequences whose prompt chunks this step computes, within a byte budget.

    A mirror lives only while its sequence computes its prompt in consecutive steps: one absent
    from a step, decoding or speculating loses it, so no freed or preempted sequence keeps
    memory, and a sequence that comes back (swapped in, recomputed) starts from its blocks
    again.
    """

    def __init__(
        self,
        pool: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        budget_bytes: int,
        max_len: int,  # the longest sequence: a mirror is made this long at once, within budget
        min_context: int | None = None,  # None: MIN_CONTEXT
    ) -> None:
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.max_len = max_len
        self.min_context = MIN_CONTEXT if min_context is None else min_context
        self.mirrors: dict[int, torch.Tensor] = {}  # seq_id -> [L, 2, kv_heads, capacity, D]
        self.lengths: dict[int, int] = {}  # seq_id -> positions the mirror holds
        self.prompt_lens: dict[int, int] = {}  # seq_id -> its prompt's length, until freed
        self.made = 0  # mirrors started (at a long prompt's first chunk, or filled)
        self.fills = 0  # mirrors filled from the blocks (a first chunk deep enough, or a rebuild)

    def for_step(
        self,
        seqs: list[ScheduledSeq],
        tables: torch.Tensor,  # [len(seqs), max_blocks] int64
        decodes: bool = False,  # every entry is one token that samples (the caller checked)
    ) -> list[torch.Tensor | None] | None:  # per seq: its mirror, or None (gathered path)
        """Each scheduled sequence's mirror, grown to hold this step's tokens and filled up to
        its start position; mirrors of sequences not computing a chunk now are dropped. None
        where no sequence has one."""
        for s in seqs:
            if s.prompt_len is not None:  # sent with a sequence's first appearance
                self.prompt_lens[s.seq_id] = s.prompt_len
        if decodes and not self.mirrors:
            return None  # decodes alone and no mirror to continue: most steps
        wanted = {s.seq_id for s in seqs if self._is_deep_chunk(s) or self._continues(s)}
        for seq_id in [i for i in self.mirrors if i not in wanted]:
            self._drop(seq_id)
        out: list[torch.Tensor | None] = []
        for index, seq in enumerate(seqs):
            out.append(self._prepare(seq, tables[index]) if seq.seq_id in wanted else None)
        return out

    def _is_deep_chunk(self, seq: ScheduledSeq) -> bool:
        """A prompt chunk (or recompute) at min_context or deeper: several tokens, or one that
        does not sample (a chunk that deep is often a single token; with a mirror it is not
        batched with the decodes, whose padded gather would then reach its whole context)."""
        chunk = len(seq.token_ids) > 1 or not seq.sample or seq.layers is not None
        if not chunk or seq.num_spec_tokens:
            return False
        if seq.start_pos >= self.min_context:
            return True
        # A prompt that will be that deep before it ends mirrors from its first chunk on: its
        # chunks then append to the mirror, and no step copies the context from the blocks
        # into fresh pages across the mirror's whole width (which a fill does at once).
        prompt_len = self.prompt_lens.get(seq.seq_id, 0)
        return prompt_len > self.min_context and seq.start_pos + len(seq.token_ids) < prompt_len

    def _continues(self, seq: ScheduledSeq) -> bool:
        """A prompt's last chunk of one token, right after the positions its mirror holds: it
        samples, so it looks like a decode, but in the decode batch its padded gather would
        reach the whole context for every row. Decodes after it drop the mirror."""
        return (
            len(seq.token_ids) == 1
            and not seq.num_spec_tokens
            and self.lengths.get(seq.seq_id) == seq.start_pos
            and self.prompt_lens.get(seq.seq_id) == seq.start_pos + 1
        )

    def _prepare(
        self,
        seq: ScheduledSeq,
        table: torch.Tensor,  # [max_blocks] int64
    ) -> torch.Tensor | None:
        end = seq.start_pos + len(seq.token_ids)
        mirror = self.mirrors.get(seq.seq_id)
        # What the mirror must hold already: the context before the chunk, or with a chunk's
        # later layer part (layer_parts.py) the chunk too, whose earlier layers the parts
        # before wrote (their later layers this part writes).
        known = end if seq.layers is not None and seq.layers[0] > 0 else seq.start_pos
        # The mirror holds what the blocks hold only if it wrote the chunks just before this
        # one; any other start (a recompute, a preemption in between) rebuilds it from them.
        if mirror is not None and known != self.lengths[seq.seq_id]:
            self._drop(seq.seq_id)
            mirror = None
        fresh = mirror is None  # then filled from the blocks up to `known`
        if fresh or mirror.shape[3] < end:
            mirror = self._grow(seq.seq_id, mirror, 0 if fresh else seq.start_pos, end)
            if mirror is None:
                return None
        if fresh:
            self.made += 1
            if known:
                self._fill(mirror, table, known)
        # The attention writes this step's K/V at start_pos:end (kernels/reference.py).
        self.lengths[seq.seq_id] = end
        return mirror

    def _grow(
        self, seq_id: int, old: torch.Tensor | None, keep: int, end: int
    ) -> torch.Tensor | None:
        """A mirror with room for `end` positions holding the old one's first `keep`; None when
        the budget has no room (the sequence then gathers from its blocks). It is made as long
        as the longest sequence at once, so a prompt never waits on a growth's copy mid-way
        (its pages become resident only as chunks write them)."""
        num_layers, _, _, _, num_kv_heads, head_dim = self.pool.shape
        per_position = num_layers * 2 * num_kv_heads * head_dim * self.pool.element_size()
        held = self.bytes_held() - (0 if old is None else old.numel() * old.element_size())
        capacity = min(max(end, self.max_len), (self.budget_bytes - held) // per_position)
        if capacity < end:
            self._drop(seq_id)
            return None
        mirror = self.pool.new_empty((num_layers, 2, num_kv_heads, capacity, head_dim))
        if old is not None and keep:
            mirror[:, :, :, :keep].copy_(old[:, :, :, :keep])
        self.mirrors[seq_id] = mirror
        return mirror

    def _fill(
        self,
        mirror: torch.Tensor,  # [num_layers, 2, num_kv_heads, capacity, head_dim]
        table: torch.Tensor,  # [max_blocks] int64
        length: int,
    ) -> None:
        """Copy the first `length` positions of a sequence's K/V from its blocks, every layer."""
        block_size = self.pool.shape[3]
        blocks = table[: -(-length // block_size)]
        # [L, 2, n, block_size, kv_heads, D] -> [L, 2, kv_heads, n * block_size, D]
        gathered = self.pool.index_select(2, blocks).permute(0, 1, 4, 2, 3, 5)
        gathered = gathered.reshape(*mirror.shape[:3], -1, mirror.shape[4])
        mirror[:, :, :, :length].copy_(gathered[:, :, :, :length])
        self.fills += 1

    def clear(self) -> None:
        self.mirrors.clear()
        self.lengths.clear()

    def forget(self, seq_id: int) -> None:
        """The sequence was freed: its mirror goes now, not at the next step."""
        self._drop(seq_id)
        self.prompt_lens.pop(seq_id, None)

    def _drop(self, seq_id: int) -> None:
        self.mirrors.pop(seq_id, None)
        self.lengths.pop(seq_id, None)

    def bytes_held(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.mirrors.values())
