"""The step's token budget: which running groups draw on it first, and how much one prompt takes.

The scheduler asks these once per step (the order, the cap) and once per group (its share).
"""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.sequence import SeqStatus, Sequence, SequenceGroup


def budget_order(running: list[SequenceGroup], order: str) -> list[SequenceGroup]:
    """Running groups in the order they draw on the token budget. decode-first: groups whose
    every sequence needs one token, then the rest (prompt chunks, recomputes), each part in
    policy order; so a burst of prefill never delays a running stream's next token."""
    if order == "arrival":
        return list(running)
    decoding: list[SequenceGroup] = []
    computing: list[SequenceGroup] = []
    for group in running:  # one pass: this runs every step
        (decoding if is_decoding(group) else computing).append(group)
    return decoding + computing


def step_prefill_cap(
    running: list[SequenceGroup], prefill_cap: int | None, row_cap: int | None = None
) -> tuple[int | None, bool]:
    """This step's cap on one request's prompt tokens: while some running group decodes,
    so that a long prompt does not stretch the step its streams wait on, and while requests
    wait to start, so that a long prompt does not take the whole budget from their first
    chunks until it is done. A step that already computes D decode rows may take up to D
    prompt tokens per request (that at most doubles it): the cap binds with few streams.
    D counts rows, not sequences: beside others a request of n samples decodes at most
    `row_cap` of them per step (capped_decode_rows). Also whether any sequence decodes."""
    if prefill_cap is None:
        return None, False
    others = len(running) > 1
    decoding = sum(_decode_rows(g, row_cap, others) for g in running if is_decoding(g))
    return max(prefill_cap, decoding), decoding > 0


def _decode_rows(group: SequenceGroup, row_cap: int | None, others_running: bool) -> int:
    """The decode rows a decoding group takes this step (capped_decode_rows' bound)."""
    if _row_cap_applies(group, row_cap, others_running):
        return min(group.num_seats, row_cap)
    return group.num_seats


def _row_cap_applies(group: SequenceGroup, row_cap: int | None, others_running: bool) -> bool:
    """The per-request row cap counts for this group: set, others run, and not a beam search
    (its beams step together)."""
    return row_cap is not None and others_running and group.beam is None


def share(
    group: SequenceGroup,
    budget: int,
    cap: int | None,
    decoding: bool,
    others_queued: Callable[[], bool],
    context_cost_tokens: int,
) -> int:
    """The part of the step's budget one group may take. With a cap (CPU), chunks count
    context-free tokens: a chunk deep into a long prompt attends to all of it, so it gets
    fewer tokens for the same step time (ExecutorReady.context_cost_tokens); then no step
    runs much longer than its budget's worth, and a request that arrives meanwhile waits
    at most about one such step for its first chunk."""
    if cap is None or is_decoding(group):
        return budget
    if not (decoding or others_queued()):
        cap = budget  # alone: the whole budget (context-free)
    if context_cost_tokens:
        context = group.live_seqs()[0].num_computed_tokens
        cap = max(1, cap * context_cost_tokens // (context_cost_tokens + context))
    return min(budget, cap)


def is_decoding(group: SequenceGroup) -> bool:
    seqs = group.seqs
    if len(seqs) == 1:  # most groups, every step: no generator, no properties
        seq = seqs[0]
        return seq.status is SeqStatus.FINISHED or len(seq.token_ids) - seq.num_computed_tokens <= 1
    return all(seq.num_uncomputed_tokens <= 1 for seq in group.live_seqs())


def capped_decode_rows(
    group: SequenceGroup,
    live: list[Sequence],
    row_cap: int | None,
    others_running: bool,
) -> list[tuple[Sequence, int]] | None:
    """A decoding request's rows this step when the per-request row cap binds (its samples
    take turns, the least advanced first, so none falls more than a step behind), or None:
    no cap, the request alone, fewer sequences than the cap, or a beam search (its beams
    step together)."""
    if not _row_cap_applies(group, row_cap, others_running) or len(live) <= row_cap:
        return None
    if any(seq.num_uncomputed_tokens > 1 for seq in live):
        return None  # not decoding (a prompt, a recompute): the token budget shares it
    # sorted() is stable: among equals the group's own order, so the same step repeats alike.
    behind = sorted(live, key=lambda seq: seq.num_tokens)
    return [(seq, 1) for seq in behind[:row_cap] if seq.num_uncomputed_tokens == 1]
