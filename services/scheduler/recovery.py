"""Restart recovery: what a request keeps and what it loses when a new executor replaces a dead one.

The new executor has empty pools and knows no sequence: every unfinished group is recomputed from
its prompt and the tokens it has already emitted, and is announced again with its sample index
and prompt length, so that the new executor's seeded draws repeat the old one's.
"""

from __future__ import annotations

from services.scheduler.sequence import SeqStatus, SequenceGroup


def start_over(groups: list[SequenceGroup]) -> None:
    """Make each group wait to be recomputed on an executor that has never seen it."""
    for group in groups:
        for seq in group.live_seqs():
            seq.num_computed_tokens = 0
            seq.announced = False
        if group.forked and len(group.seqs) < group.sampling.num_samples:
            group.forked = False  # the fork step was lost with the executor: fork again
        group.set_status(SeqStatus.WAITING)
