"""Block tables over the device and CPU pools: allocate on demand, fork, copy-on-write, swap,
reuse of cached prefix blocks, and freeing of blocks a sliding window has left behind."""

from __future__ import annotations

from collections import Counter

from services.scheduler.block_pool import BlockPool
from services.scheduler.prefix_cache import Digest, DigestFn, PrefixCache, block_digest
from services.scheduler.sequence import SequenceGroup
from shared.sampling import SamplingParams

# (seq_id, num_computed_tokens, num_new_tokens): one sequence's write this step.
Write = tuple[int, int, int]
# A table entry whose block was freed because no future query of the sequence can see it (every
# layer's window has passed it). The entry keeps the later blocks at their logical positions;
# the executor receives block 0 there and the kernels never read it.
NULL_BLOCK = -1


def real_blocks(table: list[int]) -> list[int]:
    """The entries of a table that hold a block (not NULL_BLOCK), in logical order."""
    return [b for b in table if b != NULL_BLOCK]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def needs_history(group: SequenceGroup) -> bool:
    """Whether the executor must be fed every token of the group's sequences: it learns penalty
    counts and grammar state from the tokens plans feed it, and a block reused instead of
    computed is never fed; prompt logprobs likewise need every prompt token computed."""
    return group.sampling.needs_history


class BlockManager:
    """Maps each sequence's logical blocks to physical ones. Only this class decides block ids."""

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool = False,
        digest_fn: DigestFn = block_digest,
        sliding_window: int | None = None,
        max_chunk_tokens: int | None = None,
    ) -> None:
        self.block_size = block_size
        # Set only when every layer of the model attends within a window (the largest one): then
        # a query at position p reads nothing before p - sliding_window + 1, and blocks wholly
        # before the next query's window are freed. A model with any full-context layer needs
        # every block and leaves this None.
        self.sliding_window = sliding_window
        # The most tokens one step computes for a sequence (the token budget): with a window, a
        # sequence never holds more than the blocks its largest chunk's queries see.
        self.max_chunk_tokens = max_chunk_tokens
        # Only device blocks are cached: a swapped-out block's device copy stays findable.
        self.prefix_cache = PrefixCache(digest_fn) if enable_prefix_caching else None
        self.device = BlockPool(num_device_blocks, "device", self.prefix_cache)
        self.cpu = BlockPool(num_cpu_blocks, "cpu")
        self.tables: dict[int, list[int]] = {}  # seq_id -> device block ids, logical order
        self.cpu_tables: dict[int, list[int]] = {}  # seq_id -> cpu block ids of swapped seqs
        # seq_id -> how many table entries the executor already holds; absent means its copy is
        # stale (new seq, copy-on-write, swap-in) and the next plan must send the whole table.
        self._synced: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet in a plan
        # Prefix caching. seq_id -> the chained digest of each full block so far (they depend on
        # tokens only, so they survive swaps), and how many leading table entries were already
        # offered to the cache.
        self._digests: dict[int, list[Digest]] = {}
        self._num_offered: dict[int, int] = {}

    # ---- sizing -------------------------------------------------------------------------------
    def num_new_blocks(self, writes: list[Write], swapped: bool = False) -> int:
        """Device blocks that `writes` need: missing blocks plus copy-on-write of shared ones.

        A shared block with ref count r written by w of these sequences needs w copies if w < r,
        else w - 1: the last writer finds itself sole owner and writes in place. With swapped=True
        the tables are the CPU ones (what the writes will need once swapped back in). Blocks a
        sliding window leaves behind, held by their writer alone, are freed before that write's
        new ones are taken: they count back against that write's need.
        """
        tables, pool = (self.cpu_tables, self.cpu) if swapped else (self.tables, self.device)
        needed = 0
        writers: dict[int, int] = {}  # shared block -> writers (a plain dict: called per group)
        ref_counts = pool.ref_counts
        for seq_id, num_computed, num_new in writes:
            table = tables.get(seq_id, [])
            end_block = cdiv(num_computed + num_new, self.block_size)
            missing = max(0, end_block - len(table))
            if self.sliding_window and not swapped:
                # Only this write's own allocation can use what it frees: the writes are
                # allocated one after another, and an earlier one must not count on a later's.
                behind = real_blocks(self._behind_window(table, num_computed))
                freed = sum(pool.ref_counts[b] == 1 for b in behind)
                missing = max(0, missing - freed)
            needed += missing
            for i in range(num_computed // self.block_size, min(end_block, len(table))):
                if ref_counts[table[i]] > 1:
                    writers[table[i]] = writers.get(table[i], 0) + 1
        for block_id, w in writers.items():
            needed += w if w < ref_counts[block_id] else w - 1
        return needed

    def num_blocks_of(self, seq_ids: list[int], cpu: bool = False) -> int:
        """Distinct physical blocks held by these sequences (shared blocks count once)."""
        tables = self.cpu_tables if cpu else self.tables
        return len({b for s in seq_ids for b in tables.get(s, []) if b != NULL_BLOCK})

    # ---- the allocation policy's questions (paged: blocks on demand, any free block will do) --
    # The scheduler asks only these (and num_new_blocks) whether it may admit or grow a group;
    # the Orca baselines (kv_policy.py) answer them with contiguous reservations instead.
    def validate_request(self, sampling: SamplingParams) -> None:
        """Raise InvalidRequestError for requests this policy cannot serve (paged: none)."""

    def admission_blocks(
        self, group: SequenceGroup, reused: dict[int, list[int]] | None = None
    ) -> int:
        """Device blocks a waiting group takes from the free blocks to be admitted: its whole
        (re)computation, less the cached blocks it reuses (`reused`: seq_id -> block ids) that
        others hold. Recomputed samples or beams share the first one's full prompt blocks."""
        live = group.live_seqs()
        held = {b for ids in (reused or {}).values() for b in ids if self.device.ref_counts[b]}
        if self.sliding_window and self.max_chunk_tokens:
            # Reused blocks are all taken at admission, then those behind the window freed;
            # samples are counted unshared (an upper bound).
            peak = cdiv(self.sliding_window - 1 + self.max_chunk_tokens, self.block_size) + 1
            blocks = sum(
                min(
                    cdiv(s.num_tokens, self.block_size),
                    peak + len((reused or {}).get(s.seq_id, [])),
                )
                for s in live
            )
            return max(0, blocks - len(held))
        shared = self.shared_prompt_blocks(group)
        blocks = sum(cdiv(s.num_tokens, self.block_size) - shared for s in live) + shared
        return blocks - len(held)

    def shared_prompt_blocks(self, group: SequenceGroup) -> int:
        """Full prompt blocks that a group's live sequences (parallel samples, beams) hold in
        common, also after a recompute; 0 for a single sequence, and for sequences that must be
        fed their whole prompt (needs_history: a new executor may have to learn it)."""
        if len(group.seqs) < 2 or needs_history(group) or len(group.live_seqs()) < 2:
            return 0
        if self.sliding_window:
            # The first sample frees prompt blocks behind its window as it goes on, which the
            # others, starting at the prompt's end, may still need: each computes its own.
            return 0
        return group.seqs[0].prompt_len // self.block_size

    def can_admit(self, group: SequenceGroup, num_blocks: int) -> bool:
        """Whether the free blocks can take the group's admission_blocks (paged: any will do)."""
        return True

    def admit(self, group: SequenceGroup) -> None:
        """Called once as the group is admitted (paged: nothing is reserved up front)."""

    def held_blocks(self, seq_id: int) -> list[int]:
        """Device blocks this sequence holds, in logical order (reservations included; entries
        freed behind a sliding window left out)."""
        return real_blocks(self.tables.get(seq_id, []))

    def unusable_free_blocks(self, num_blocks: int) -> int:
        """Free blocks that cannot serve a request needing num_blocks (paged: none)."""
        return 0

    # ---- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> None:
        """Make positions [num_computed, num_computed + num_new) writable by this sequence alone.

        Callers check num_new_blocks() against device.num_free first; this never fails halfway.
        Blocks that fall out of the window are freed first (num_new_blocks counted them back
        against this write's own need).
        """
        self._free_behind_window(seq_id, num_computed)
        table = self.tables.setdefault(seq_id, [])
        end_block = cdiv(num_computed + num_new, self.block_size)
        for i in range(num_computed // self.block_size, min(end_block, len(table))):
            old = table[i]
            if self.device.ref_counts[old] > 1:
                new = self.device.allocate()
                self._copies.append((old, new))
                self.device.decref(old)
                table[i] = new
                self._synced.pop(seq_id, None)
        while len(table) < end_block:
            table.append(self.device.allocate())

    def writes_in_place(self, seq_id: int, position: int) -> bool:
        """Whether writing position `position` of the sequence needs nothing of the pool: the
        slot lies in a block of its table that it holds alone (no allocation, no copy-on-write;
        allocate_slots would do nothing). Without a sliding window only: a window may free a
        block at any position."""
        table = self.tables.get(seq_id)
        if table is None or self.sliding_window:
            return False
        index = position // self.block_size
        return index < len(table) and self.device.ref_counts[table[index]] == 1

    def grow_decodes(self, writes: list[tuple[int, int]]) -> list[tuple[list[int], bool]] | None:
        """The lookahead plan's block work: position p of each (seq_id, p) made writable, as
        allocate_slots(seq_id, p, 1) does, and each sequence's table update, as
        take_table_update() says it; None, with nothing taken, when the new blocks do not fit
        the free pool.

        Most decodes write into a block they hold alone, and the executor already has their
        table: nothing to allocate and nothing to send, found without the general path's
        calls (at 256 sequences a step, those were most of the plan's host time). The rest (a
        block boundary, a shared block, a stale table, a sliding window) take that path.
        """
        synced = self._synced
        updates: list[tuple[list[int], bool] | None] = []
        general = []  # indexes into writes
        for i, (seq_id, position) in enumerate(writes):
            # (absent from _synced: a stale table, which goes out whole)
            if self.writes_in_place(seq_id, position) and synced.get(seq_id) == len(
                self.tables[seq_id]
            ):
                updates.append(([], False))
            else:
                general.append(i)
                updates.append(None)
        if general:
            slow = [(writes[i][0], writes[i][1], 1) for i in general]
            if self.num_new_blocks(slow) > self.device.num_free:
                return None
            for i in general:
                seq_id, position = writes[i]
                self.allocate_slots(seq_id, position, 1)
                updates[i] = self.take_table_update(seq_id)
        return updates  # type: ignore[return-value]  # every None was filled in above

    def _free_behind_window(self, seq_id: int, num_computed: int) -> None:
        """Free the blocks no query from position num_computed on can see, as vLLM v1's
        SlidingWindowManager does: the query at num_computed sees positions from
        num_computed - sliding_window + 1, so blocks wholly before that are done with.

        Safe with a step in flight (async scheduling): a freed block can be written only by a
        later step, which runs after the one that may still read it."""
        if not self.sliding_window:
            return  # most models: every decode of every step comes through here
        table = self.tables.get(seq_id)
        if not table:
            return
        freed = self._behind_window(table, num_computed)
        for i in range(len(freed)):
            table[i] = NULL_BLOCK  # freed entries are a prefix of the table
        # The executor's copy keeps the old ids there; it never reads them, so no resend.
        self.device.release(real_blocks(freed))

    def _behind_window(self, table: list[int], num_computed: int) -> list[int]:
        """The table's entries wholly before the window of the query at num_computed (freed ones
        included); none without a window."""
        if not self.sliding_window:
            return []
        first_needed = max(0, num_computed - self.sliding_window + 1) // self.block_size
        return table[:first_needed]

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks of the first num_tokens positions: speculative slots past them
        were rejected, and blocks holding nothing else go back to the pool. A kept block's
        rejected slots are simply written again later. The executor's copy of a shortened
        table is replaced with the next plan."""
        table = self.tables.get(seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        self.device.release(real_blocks(table[keep:]))
        del table[keep:]
        if self._synced.get(seq_id, 0) > keep:
            self._synced.pop(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (ref += 1); writes later copy on demand."""
        table = list(self.tables[parent_id])
        for block_id in real_blocks(table):
            self.device.incref(block_id)
        self.tables[child_id] = table
        self._digests[child_id] = list(self._digests.get(parent_id, []))
        self._num_offered[child_id] = self._num_offered.get(parent_id, 0)

    def share_prefix(self, src_id: int, dst_id: int, num_blocks: int) -> None:
        """dst drops what it holds and shares src's first num_blocks blocks (written, full)."""
        self.device.release(real_blocks(self.tables.pop(dst_id, [])))
        table = self.tables[src_id][:num_blocks]
        for block_id in real_blocks(table):
            self.device.incref(block_id)
        self.tables[dst_id] = table
        self._synced.pop(dst_id, None)
        self._num_offered[dst_id] = 0

    def free(self, seq_id: int) -> None:
        self.device.release(real_blocks(self.tables.pop(seq_id, [])))
        self.cpu.release(real_blocks(self.cpu_tables.pop(seq_id, [])))
        self._synced.pop(seq_id, None)
        self._digests.pop(seq_id, None)
        self._num_offered.pop(seq_id, None)

    # ---- prefix caching -----------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix_cache) if self.prefix_cache is not None else 0

    def cached_prefix(self, seq_id: int, token_ids: list[int]) -> list[int]:
        """Device blocks holding the longest cached prefix of these tokens, verified block by
        block; changes nothing. At least one token is left to compute, so the step samples."""
        if self.prefix_cache is None:
            return []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        digests = self._digests_of(seq_id, token_ids, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            parent = digests[i - 1] if i else None
            block_id = self.prefix_cache.find(digests[i], parent, token_ids[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def reuse(self, seq_id: int, block_ids: list[int]) -> None:
        """A sequence with no blocks takes these cached ones by reference (its computed prefix)."""
        if self.tables.get(seq_id):
            raise RuntimeError(f"seq {seq_id} already holds blocks; reuse starts a table")
        for block_id in block_ids:
            self.device.reuse(block_id)
        self.tables[seq_id] = list(block_ids)
        self._num_offered[seq_id] = len(block_ids)

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Offer the sequence's full blocks whose K/V are now written to the prefix cache.

        Called once the step that wrote them is reported, so a block is never found before its
        K/V exist (lookups happen only in schedule(), which never runs with a step in flight).
        """
        if self.prefix_cache is None:
            return
        bs = self.block_size
        start, end = self._num_offered.get(seq_id, 0), num_computed // bs
        if end <= start:
            return
        digests = self._digests_of(seq_id, token_ids, end)
        table = self.tables[seq_id]
        for i in range(start, end):
            if table[i] == NULL_BLOCK:
                # Freed behind the window before it was offered (a step planned ahead): it may
                # hold another sequence's tokens now. Later blocks stay unreachable, since a
                # lookup stops at the first block it misses.
                continue
            parent = digests[i - 1] if i else None
            self.prefix_cache.add(table[i], digests[i], parent, token_ids[i * bs : (i + 1) * bs])
        self._num_offered[seq_id] = end

    def _digests_of(self, seq_id: int, token_ids: list[int], num_blocks: int) -> list[Digest]:
        """The chained digests of the sequence's first num_blocks blocks, memoized per sequence."""
        digests = self._digests.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(digests), num_blocks):
            parent = digests[i - 1] if i else None
            digests.append(self.prefix_cache.digest(parent, token_ids[i * bs : (i + 1) * bs]))
        return digests

    # ---- swapping -----------------------------------------------------------------------------
    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move these sequences' blocks to the CPU pool, keeping sharing; returns (device, cpu)."""
        return self._move(seq_ids, self.tables, self.cpu_tables, self.device, self.cpu)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move these sequences' blocks back to the device pool; returns (cpu, device) pairs.

        The new device blocks are offered to the prefix cache again after the next step (their
        content may have been evicted meanwhile)."""
        for seq_id in seq_ids:
            self._num_offered[seq_id] = 0
        return self._move(seq_ids, self.cpu_tables, self.tables, self.cpu, self.device)

    def _move(
        self,
        seq_ids: list[int],
        src_tables: dict[int, list[int]],
        dst_tables: dict[int, list[int]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
    ) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}  # src block -> dst block, so shared blocks move once
        for seq_id in seq_ids:
            new_table = []
            # A recomputing sample may hold no blocks yet (the budget reached only its siblings).
            src_table = src_tables.pop(seq_id, [])
            for src in src_table:
                if src == NULL_BLOCK:  # freed behind the window: nothing to move
                    new_table.append(NULL_BLOCK)
                    continue
                if src in mapping:
                    dst_pool.incref(mapping[src])
                else:
                    mapping[src] = dst_pool.allocate()
                new_table.append(mapping[src])
            src_pool.release(real_blocks(src_table))
            dst_tables[seq_id] = new_table
            self._synced.pop(seq_id, None)
        return list(mapping.items())

    # ---- plan support -------------------------------------------------------------------------
    def take_table_update(self, seq_id: int) -> tuple[list[int], bool]:
        """What the next plan sends for this seq: (block ids, replace_table)."""
        table = self.tables[seq_id]
        synced = self._synced.get(seq_id)
        self._synced[seq_id] = len(table)
        delta = list(table) if synced is None else table[synced:]
        if self.sliding_window:
            # Freed entries go out as block 0: a valid id, outside every window, never read.
            delta = [max(b, 0) for b in delta]
        return delta, synced is None

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def check(self) -> None:
        """Recompute every ref count from the tables and compare with both pools."""
        overlap = self.tables.keys() & self.cpu_tables.keys()
        if overlap:
            raise AssertionError(f"sequences {sorted(overlap)} hold device and cpu blocks at once")
        self.device.check(Counter(b for t in self.tables.values() for b in real_blocks(t)))
        self.cpu.check(Counter(b for t in self.cpu_tables.values() for b in real_blocks(t)))
