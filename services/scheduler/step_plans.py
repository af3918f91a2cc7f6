"""Plan assembly: the StepPlan the executor runs, built from what the scheduler decided, and the
plans in flight until update() takes their results.

Two builders: a full plan (any mix of prompt chunks, decodes, forks and cache moves) and the
lookahead plan of async scheduling (one PENDING_TOKEN decode per sequence of the plan in
flight). Both end in one place, which numbers the plan and hands over the pending block copies
and freed sequence ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import Sequence, SequenceGroup
from shared.protocol import PENDING_TOKEN, PromptTargets, ScheduledSeq, StepPlan


@dataclass
class PlanEntry:
    """One sequence's share of a planned step, as the scheduler decided it."""

    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int  # with spec_tokens: 1 + len(spec_tokens)
    fork_seq_ids: list[int]
    # Speculative decoding: tokens proposed after the sequence's last one, verified this step.
    spec_tokens: list[int] = field(default_factory=list)
    # A deep chunk's layer part (layer_parts.py): the layers it computes, and whether more parts
    # of the chunk follow (then it computes no token of the sequence yet, and samples nothing).
    layers: tuple[int, int] | None = None
    partial: bool = False


class StepPlans:
    def __init__(self) -> None:
        self.inflight: dict[int, list[PlanEntry]] = {}  # step_id -> what that plan scheduled
        self._victims: dict[int, list[SequenceGroup]] = {}  # step_id -> swapped out by it
        # Sequences ended since the last plan: the next plan tells the executor to forget them.
        self.freed_seq_ids: list[int] = []
        self._next_step_id = 0

    def plan(
        self,
        block_manager: BlockManager,
        entries: list[PlanEntry],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        victims: list[SequenceGroup],
    ) -> StepPlan:
        """The plan of a scheduled step; a sequence's sampling parameters and prompt length go
        with its first appearance only. Layer parts go last, where the executor runs them
        after the batch."""
        seqs, parts = [], []
        for entry in entries:
            seq = entry.seq
            block_ids, replace = block_manager.take_table_update(seq.seq_id)
            start = seq.num_computed_tokens
            end = start + entry.num_new_tokens - len(entry.spec_tokens)  # real tokens only
            num_tokens = len(seq.token_ids)
            targets = None
            if entry.group.sampling.prompt_logprobs is not None:  # (most plans: no call)
                targets = prompt_logprob_targets(entry.group, seq, start, end)
            (seqs if entry.layers is None else parts).append(
                ScheduledSeq(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[start:end] + entry.spec_tokens,
                    start_pos=start,
                    block_ids=block_ids,
                    replace_table=replace,
                    sample=end == num_tokens and not entry.partial,
                    fork_seq_ids=entry.fork_seq_ids,
                    sampling=None if seq.announced else entry.group.sampling,
                    sample_index=seq.index,
                    prompt_len=None if seq.announced else seq.prompt_len,
                    rope_len=num_tokens if start + 1 < num_tokens else None,
                    prompt_targets=targets,
                    num_spec_tokens=len(entry.spec_tokens),
                    layers=entry.layers,
                )
            )
            seq.announced = True
        return self._issue(block_manager, seqs + parts, entries, swap_out, swap_in, victims)

    def plan_ahead(self, block_manager: BlockManager, ahead: list[PlanEntry]) -> StepPlan | None:
        """The next decode of each of `ahead` (entries of the one plan in flight), with the
        token that plan samples still unknown; None when their new blocks do not fit."""
        # The step in flight computes position num_computed_tokens; this one the next.
        writes = [(e.seq.seq_id, e.seq.num_computed_tokens + 1) for e in ahead]
        updates = block_manager.grow_decodes(writes)
        if updates is None:
            return None
        seqs = [
            ScheduledSeq(seq_id, [PENDING_TOKEN], position, block_ids, replace, True)
            for (seq_id, position), (block_ids, replace) in zip(writes, updates)
        ]
        # The entries in flight say what this plan's do (one decode each, no fork, no
        # proposals, no layer part: lookahead_seqs) and nothing changes an entry once made, so
        # this plan takes them as they are rather than a copy of each.
        return self._issue(block_manager, seqs, list(ahead), [], [], [])

    def take(self, step_id: int) -> tuple[list[PlanEntry], list[SequenceGroup]]:
        """A plan's entries and swap-out victims, once its result is in: no longer in flight."""
        return self.inflight.pop(step_id), self._victims.pop(step_id)

    def forget(self) -> None:
        """A new executor replaced the one that ran these plans: none of them returns, and it
        knows no sequence to forget."""
        self.inflight.clear()
        self._victims.clear()
        self.freed_seq_ids = []

    def _issue(
        self,
        block_manager: BlockManager,
        seqs: list[ScheduledSeq],
        entries: list[PlanEntry],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        victims: list[SequenceGroup],
    ) -> StepPlan:
        """The plan of these scheduled sequences, with the pending copies and freed ids; it is
        in flight from now until update() takes its result."""
        plan = StepPlan(
            step_id=self._next_step_id,
            seqs=seqs,
            swap_out=swap_out,
            swap_in=swap_in,
            copies=block_manager.take_copies(),
            freed_seq_ids=self.freed_seq_ids,
        )
        self.freed_seq_ids = []
        self.inflight[plan.step_id] = entries
        self._victims[plan.step_id] = victims
        self._next_step_id += 1
        return plan


def prompt_logprob_targets(
    group: SequenceGroup, seq: Sequence, start: int, end: int
) -> PromptTargets | None:
    """What a chunk computing positions start .. end - 1 of seq scores: row i predicts
    position start + i + 1, so positions start + 1 .. end, never those already scored (a
    recomputed prompt) nor past the prompt."""
    if group.sampling.prompt_logprobs is None or group.prompt_logprobs_done:
        return None
    first = max(start + 1, group.next_prompt_logprob_pos())
    last = min(end + 1, seq.prompt_len)  # exclusive
    if first >= last:
        return None
    return PromptTargets(first - 1 - start, seq.token_ids[first:last])
