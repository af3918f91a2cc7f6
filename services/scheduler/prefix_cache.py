"""Automatic prefix caching: full device blocks found again by a chained hash of their tokens."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Digest = bytes
DigestFn = Callable[[Digest | None, Sequence[int]], Digest]


def block_digest(parent: Digest | None, token_ids: Sequence[int]) -> Digest:
    """sha256 of the parent block's digest and this block's token ids.

    A block's K/V depend on every token before it, so the digest chains through the parent's and
    names the whole prefix. Nothing else changes the K/V today (one model per server, no LoRA
    adapters, no multimodal inputs); anything that did would be hashed in here too.
    """
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(frozen=True)
class CachedBlock:
    digest: Digest
    parent: Digest | None
    token_ids: tuple[int, ...]


class PrefixCache:
    """digest -> device block for full blocks whose K/V are written, and what each one holds.

    A hit is verified against the stored tokens and parent digest, so a hash collision costs a
    miss, never wrong K/V. One block per digest: a second block computed with the same content
    (two requests prefilled the same prefix in one step) is simply not cached.
    """

    def __init__(self, digest_fn: DigestFn = block_digest) -> None:
        self.digest = digest_fn
        self._block_of: dict[Digest, int] = {}
        self._entry_of: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._entry_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry_of

    def find(self, digest: Digest, parent: Digest | None, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens after that parent, or None."""
        block_id = self._block_of.get(digest)
        if block_id is None:
            return None
        entry = self._entry_of[block_id]
        if entry.parent != parent or entry.token_ids != tuple(token_ids):
            return None  # a collision
        return block_id

    def add(
        self, block_id: int, digest: Digest, parent: Digest | None, token_ids: Sequence[int]
    ) -> None:
        """Make a written block findable; no-op when its digest or the block is cached already."""
        if digest in self._block_of or block_id in self._entry_of:
            return
        self._block_of[digest] = block_id
        self._entry_of[block_id] = CachedBlock(digest, parent, tuple(token_ids))

    def remove(self, block_id: int) -> None:
        """Forget a block (it is being reused for other tokens)."""
        entry = self._entry_of.pop(block_id)
        del self._block_of[entry.digest]

    def check(self) -> None:
        """Every digest maps to a block whose entry carries that digest, and back."""
        if len(self._block_of) != len(self._entry_of):
            raise AssertionError("prefix cache: digest map and block entries differ in size")
        for digest, block_id in self._block_of.items():
            entry = self._entry_of.get(block_id)
            if entry is None or entry.digest != digest:
                raise AssertionError(f"prefix cache: digest of block {block_id} maps elsewhere")
