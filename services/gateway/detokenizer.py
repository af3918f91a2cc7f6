"""Incremental detokenization of one sample with stop strings; per-token texts for logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from tokenizers import decoders
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one sample's tokens into text pieces as they arrive and watches for stop strings.

    Text that could still turn out to be the start of a stop string is held back until the next
    token settles it, so a stop string never reaches the client; flush() releases the rest.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._ids: list[int] = []
        self._produced = 0  # characters decoded so far (released or pending)
        # DecodeStream buffers tokens that end inside a multi-byte UTF-8 character.
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._pending = ""  # decoded but not yet released
        self.stopped = False  # a stop string appeared: the sample is over
        # As vLLM: stop strings are not looked for until the sample has min_tokens tokens.
        self._min_tokens = min_tokens

    def step(self, token_id: int) -> str:
        """Feed one token; returns the text that is now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        if piece:
            self._pending += piece
            self._produced += len(piece)
        return self._release()

    def flush(self) -> str:
        """The sample ended without a stop string: release whatever was held back.

        Bytes of a character cut off at the very end stay inside DecodeStream; decoding the whole
        sample once recovers them (as replacement characters), so the streamed text equals
        tokenizer.decode() of the same tokens.
        """
        out, self._pending = self._pending, ""
        if self._ids and not self.stopped:
            full = self._tokenizer.decode(self._ids, skip_special_tokens=True)
            tail = full[self._produced :]
            self._produced = len(full)
            out += tail
        return out

    def _release_pending(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _release(self) -> str:
        if not self._stop or len(self._ids) < self._min_tokens:
            return self._release_pending()
        # Only the pending text needs searching: released text never holds a stop string's
        # beginning (that part is always held back), so no match can start before it.
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            out = self._pending[:cut]
            self._pending = ""
            self.stopped = True
            return out
        keep = self._partial_stop_len()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        longest = max(len(s) for s in self._stop)
        for k in range(min(len(self._pending), longest - 1), 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


class TokenTexts:
    """Per-token strings and bytes, as the logprobs of both OpenAI endpoints report them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._compute(token_id)
        return entry

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_level:
            # A byte-level token may hold part of a UTF-8 character: recover its exact bytes.
            raw = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _unicode_to_byte()
            if isinstance(raw, str) and raw and all(c in table for c in raw):
                data = bytes(table[c] for c in raw)
                return data.decode("utf-8", errors="replace"), list(data)
        text = self._tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}
