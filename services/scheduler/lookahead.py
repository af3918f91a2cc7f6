"""Async scheduling: which sequences the next step can take while this step still runs.

While the executor runs step N the scheduler may already plan step N+1, but only a step it can
plan without N's outcome: every sequence of N decodes one more token whose id the executor
alone knows yet (it sampled it in N), so the plan carries PENDING_TOKEN in its place. Anything
that needs N's outcome (a beam step, a fork, admitting or resuming a request, preemption, a
prompt chunk) waits for a synchronous step; Scheduler.schedule_ahead adds the conditions on the
pools and the queues. A grammar does not: its matcher takes N's token in the executor, which
queues N+1's forward pass first and waits for that token only to build N+1's mask. A sequence
that N's token ends (eos, a stop token, a grammar's end) wastes one token of N+1; the scheduler
drops it when N+1 is reported.
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.sequence import SeqStatus, Sequence, SequenceGroup
from services.scheduler.stop_rules import reaches_length


class _Entry(Protocol):
    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int
    fork_seq_ids: list[int]
    layers: tuple[int, int] | None


def lookahead_seqs(
    entries: list[_Entry], running: list[SequenceGroup], max_seq_len: int
) -> list[_Entry] | None:
    """The entries of the step in flight whose sequences decode again in the next step, or None
    when the next step must wait for this one's result."""
    # Attributes read directly rather than through Sequence's properties: this runs once per
    # sequence of every step planned ahead (256 and more), on the host's critical path.
    num_live = 0
    for group in running:
        seqs = group.seqs
        if len(seqs) == 1:
            num_live += seqs[0].status is not SeqStatus.FINISHED
        else:
            num_live += len(group.live_seqs())
    num_unfinished = 0
    ahead = []
    for entry in entries:
        seq, group = entry.seq, entry.group
        if seq.status is SeqStatus.FINISHED:
            continue  # aborted while the step runs
        num_unfinished += 1
        if group.beam is not None or entry.fork_seq_ids:
            return None  # the next step depends on what this one draws
        if entry.layers is not None:
            return None  # a deep chunk's layer part: the next part needs its reply first
        num_tokens = len(seq.token_ids)
        if entry.num_new_tokens != 1 or seq.num_computed_tokens + 1 != num_tokens:
            return None  # not a decode of the last known token (a prompt, a recompute)
        num_output = num_tokens - seq.prompt_len
        if reaches_length(group.sampling, num_output + 1, num_tokens + 1, max_seq_len):
            continue  # the token in flight is its last: it ends by length
        ahead.append(entry)
    if num_live != num_unfinished:
        return None  # a running sequence has no share of the step in flight
    return ahead or None
