"""KV allocation policies: paged blocks on demand, or Orca's contiguous reservations per request.

`paged` is the block manager itself. The Orca baselines reserve, at admission, one region of
consecutive blocks per request from a first-fit allocator over the same pool, sized for
`max_model_len` (orca-max), the next power of two of prompt + output (orca-pow2), or exactly
prompt + output (orca-oracle; the benchmark knows the output length through max_tokens with
ignore_eos). The sequence's block table then grows into its region, so the executor reads a
region through the same block tables, and a reservation never needs more blocks: these
policies never preempt to grow.
"""

from __future__ import annotations

from collections import Counter

from services.scheduler.block_manager import BlockManager, cdiv
from services.scheduler.contiguous import ContiguousAllocator
from services.scheduler.sequence import SequenceGroup
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams

KV_POLICIES = ("paged", "orca-max", "orca-pow2", "orca-oracle")


def final_len(prompt_len: int, sampling: SamplingParams, max_seq_len: int) -> int:
    """The length a sequence reaches if it runs to max_tokens (its true length with ignore_eos)."""
    return min(prompt_len + sampling.max_tokens, max_seq_len)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def region_tokens(policy: str, prompt_len: int, sampling: SamplingParams, max_seq_len: int) -> int:
    """Token slots an Orca policy reserves for a request at admission."""
    if policy == "orca-max":
        return max_seq_len
    final = final_len(prompt_len, sampling, max_seq_len)
    if policy == "orca-pow2":
        return min(next_pow2(final), max_seq_len)
    if policy == "orca-oracle":
        return final
    raise ValueError(f"not a reservation policy: {policy!r}")


class ContiguousBlockManager(BlockManager):
    """The block manager under an Orca policy: one contiguous region per sequence, whole."""

    def __init__(
        self, policy: str, block_size: int, num_device_blocks: int, max_seq_len: int
    ) -> None:
        # No CPU pool: a reservation never grows, so no group is preempted for growth, and a
        # swapped region would come back wherever free blocks happen to be, not contiguous.
        super().__init__(block_size, num_device_blocks, 0)
        self.policy = policy
        self.max_seq_len = max_seq_len
        self.allocator = ContiguousAllocator(self.device)
        self.regions: dict[int, list[int]] = {}  # seq_id -> its region's block ids, in order

    def validate_request(self, sampling: SamplingParams) -> None:
        if sampling.num_samples > 1:
            raise InvalidRequestError(
                f"the {self.policy} allocation policy reserves one region per request; "
                "n > 1 and best_of > 1 need the paged policy",
                param="best_of" if sampling.best_of else "n",
            )

    def region_blocks(self, group: SequenceGroup) -> int:
        seq = group.seqs[0]
        tokens = region_tokens(self.policy, seq.prompt_len, group.sampling, self.max_seq_len)
        return cdiv(tokens, self.block_size)

    def admission_blocks(self, group: SequenceGroup, reused=None) -> int:
        return self.region_blocks(group) * len(group.live_seqs())

    def can_admit(self, group: SequenceGroup, num_blocks: int) -> bool:
        return self.allocator.find(self.region_blocks(group)) is not None

    def admit(self, group: SequenceGroup) -> None:
        for seq in group.live_seqs():
            self.regions[seq.seq_id] = self.allocator.allocate(self.region_blocks(group))

    def held_blocks(self, seq_id: int) -> list[int]:
        table = self.tables.get(seq_id, [])
        region = self.regions.get(seq_id, [])
        return table + region[len(table) :]

    def unusable_free_blocks(self, num_blocks: int) -> int:
        return self.allocator.unusable_free_blocks(num_blocks)

    def num_new_blocks(self, writes, swapped: bool = False) -> int:
        # Inside its region a sequence needs nothing new; only a write past it (never, with n = 1)
        # would take blocks from the pool like the paged policy.
        outside = []
        for seq_id, num_computed, num_new in writes:
            region = self.regions.get(seq_id)
            if region is None or cdiv(num_computed + num_new, self.block_size) > len(region):
                outside.append((seq_id, num_computed, num_new))
        return super().num_new_blocks(outside, swapped) if outside else 0

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> None:
        region = self.regions.get(seq_id, [])
        table = self.tables.setdefault(seq_id, [])
        end_block = min(cdiv(num_computed + num_new, self.block_size), len(region))
        # The region's blocks already hold one reference (the reservation's); the table takes it.
        while len(table) < end_block:
            table.append(region[len(table)])
        super().allocate_slots(seq_id, num_computed, num_new)

    def trim(self, seq_id: int, num_tokens: int) -> None:
        # Inside the region, a block of rejected speculative slots stays reserved for the
        # sequence: its reference goes back from the table to the reservation.
        keep = cdiv(num_tokens, self.block_size)
        num_entries = len(self.tables.get(seq_id, []))
        for block_id in self.regions.get(seq_id, [])[keep:num_entries]:
            self.device.incref(block_id)
        super().trim(seq_id, num_tokens)

    def free(self, seq_id: int) -> None:
        region = self.regions.pop(seq_id, [])
        for block_id in region[len(self.tables.get(seq_id, [])) :]:
            self.device.decref(block_id)
        super().free(seq_id)

    def check(self) -> None:
        expected = Counter(b for t in self.tables.values() for b in t)
        for seq_id, region in self.regions.items():
            table = self.tables.get(seq_id, [])
            if table[: len(region)] != region[: len(table)]:
                raise AssertionError(f"seq {seq_id}: table {table} strays from region {region}")
            expected.update(region[len(table) :])
        self.device.check(expected)
        self.cpu.check(Counter())


def make_block_manager(
    policy: str,
    block_size: int,
    num_device_blocks: int,
    num_cpu_blocks: int,
    max_seq_len: int,
    enable_prefix_caching: bool = False,
    sliding_window: int | None = None,
    max_chunk_tokens: int | None = None,
) -> BlockManager:
    """The block manager of a policy. Prefix caching and freeing behind a sliding window apply
    to `paged` only: an Orca region is private to its request and reserved whole."""
    if policy == "paged":
        return BlockManager(
            block_size,
            num_device_blocks,
            num_cpu_blocks,
            enable_prefix_caching,
            sliding_window=sliding_window,
            max_chunk_tokens=max_chunk_tokens,
        )
    if policy not in KV_POLICIES:
        raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {policy!r}")
    return ContiguousBlockManager(policy, block_size, num_device_blocks, max_seq_len)
