"""What a group need not compute: cached prefix blocks at admission, and the prompt blocks that
recomputed parallel samples or beams share again with the first one."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager, needs_history
from services.scheduler.sequence import Sequence, SequenceGroup

# seq_id -> cached device blocks a waiting sequence would take, its computed prefix in order.
Reused = dict[int, list[int]]


class PrefixReuse:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.queried_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.hit_tokens = 0  # ... and found there, K/V written

    # ---- admission: the prefix cache -------------------------------------------------------------
    def lookup(self, manager: BlockManager, group: SequenceGroup) -> Reused:
        """Cached blocks holding the start of each live sequence's tokens; changes nothing."""
        if manager.prefix_cache is None or needs_history(group):
            return {}
        found = {}
        for seq in group.live_seqs():
            blocks = manager.cached_prefix(seq.seq_id, seq.token_ids)
            if blocks:
                found[seq.seq_id] = blocks
        return found

    def take(self, manager: BlockManager, group: SequenceGroup, reused: Reused) -> None:
        """The group is admitted: it takes its cached blocks, whose tokens count as computed."""
        if manager.prefix_cache is None:
            return
        for seq in group.live_seqs():
            blocks = reused.get(seq.seq_id)
            if blocks:
                manager.reuse(seq.seq_id, blocks)
                seq.num_computed_tokens = len(blocks) * self.block_size
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens

    # ---- planning: who computes from where -------------------------------------------------------
    def starts(
        self, manager: BlockManager, group: SequenceGroup, reused: Reused | None = None
    ) -> list[tuple[Sequence, int]]:
        """(sequence, tokens it has computed) for each live sequence that may compute now.

        `reused` counts as computed (a waiting group's lookup). While the first live sequence
        has not computed the shared prompt blocks, the others that lack them wait (see
        share_recomputed_prompt); so none is in flight when they are handed over.
        """
        shared = manager.shared_prompt_blocks(group) * self.block_size
        out = []
        for seq in group.live_seqs():
            computed = seq.num_computed_tokens
            if reused:
                computed += len(reused.get(seq.seq_id, ())) * self.block_size
            if out and computed < shared and out[0][1] < shared:
                continue
            out.append((seq, computed))
        return out

    # ---- after a step --------------------------------------------------------------------------
    def note_computed(
        self, manager: BlockManager, group: SequenceGroup, seq: Sequence, num_new: int
    ) -> None:
        """The step that wrote num_new of seq's tokens is reported: its full blocks join the
        prefix cache, and if it was a group's first sequence reaching the end of the shared
        prompt blocks, the others that waited for them take them now."""
        manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if len(group.seqs) > 1:
            shared = manager.shared_prompt_blocks(group) * self.block_size
            if seq.num_computed_tokens - num_new < shared <= seq.num_computed_tokens:
                self.share_recomputed_prompt(manager, group, seq)

    def share_recomputed_prompt(
        self, manager: BlockManager, group: SequenceGroup, first: Sequence
    ) -> None:
        """Parallel samples or beams recomputed after a preemption share their prompt again.

        The first live sequence recomputes the prompt; the others wait (starts()) until its full
        prompt blocks are written, then take them by reference, as the fork did the first time,
        and compute only their own tail. This runs as soon as the step is reported, before the
        first one may finish and free its blocks.
        """
        live = group.live_seqs()
        if first is not live[0]:
            return
        shared_blocks = manager.shared_prompt_blocks(group)
        shared = shared_blocks * self.block_size
        for seq in live[1:]:
            if seq.num_computed_tokens < shared:
                manager.share_prefix(first.seq_id, seq.seq_id, shared_blocks)
                seq.num_computed_tokens = shared
