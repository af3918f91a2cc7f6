"""Structured output: the executor's compiled grammars (an LRU bounded in bytes), the grammars
announced ready for sequences not yet started, and the per-sequence matchers made from them.

Grammars are compiled off the step loop (grammar_compiles.py, on the worker process of
grammar_worker.py); a step only makes a matcher from a grammar already here. The matcher of a
sequence advances with the tokens the executor sees it generate, and fills that sequence's row
of the step's bitmask.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from services.executor.grammar_spec import Guided, compile_guided
from shared.errors import InvalidRequestError


def make_tokenizer_info(model_dir: Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Any:
    """xgrammar's view of the model's vocabulary (loads the tokenizer: about a second)."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )


class GrammarStore:
    """One per executor (rank 0). Thread-safe: the compile thread fills it, the step loop reads
    it. Memory: the LRU holds at most cache_bytes of grammars (by xgrammar's own accounting; a
    single bigger grammar is used but not kept); grammars held for sequences are few (one per
    request between its compile and its first step) and are dropped with the sequence."""

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        cache_bytes: int,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0  # memory_size_bytes of the grammars in the LRU
        self._lru: OrderedDict[Guided, Any] = OrderedDict()
        self._held: dict[int, Any] = {}  # seq_id -> its grammar, until its matcher is made
        self._pending: dict[int, int] = {}  # seq_id -> the CompileGrammar key that will hold it
        self._lock = threading.Lock()
        self._info: Any = None
        self._info_lock = threading.Lock()
        self._compiler: Any = None  # in-process compiles only (compile_now)

    def tokenizer_info(self) -> Any:
        with self._info_lock:  # built once, by whichever thread needs it first
            if self._info is None:
                self._info = make_tokenizer_info(
                    self.model_dir, self.vocab_size, self.stop_token_ids
                )
            return self._info

    # ---- the LRU --------------------------------------------------------------------------
    def lookup(self, guided: Guided) -> Any:
        with self._lock:
            compiled = self._lru.get(tuple(guided))
            if compiled is not None:
                self._lru.move_to_end(tuple(guided))
            return compiled

    def insert(self, guided: Guided, compiled: Any) -> None:
        size = compiled.memory_size_bytes
        key = tuple(guided)
        with self._lock:
            if key in self._lru or size > self.cache_bytes:
                return
            self._lru[key] = compiled
            self.cached_bytes += size
            while self.cached_bytes > self.cache_bytes:
                _, evicted = self._lru.popitem(last=False)
                self.cached_bytes -= evicted.memory_size_bytes

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    # ---- grammars promised to sequences ---------------------------------------------------
    def expect(self, key: int, seq_ids: list[int]) -> None:
        """A compile for these sequences is queued; forget() before it ends cancels it."""
        with self._lock:
            for seq_id in seq_ids:
                self._pending[seq_id] = key

    def wanted(self, key: int, seq_ids: list[int]) -> bool:
        """Some sequence still waits for this compile (else it is skipped: all were freed)."""
        with self._lock:
            return any(self._pending.get(s) == key for s in seq_ids)

    def hold(self, key: int, seq_ids: list[int], compiled: Any | None) -> None:
        """The compile `key` ended: keep its grammar for the sequences still waiting for it
        (none on a failure, when compiled is None)."""
        with self._lock:
            for seq_id in seq_ids:
                if self._pending.get(seq_id) == key:
                    del self._pending[seq_id]
                    if compiled is not None:
                        self._held[seq_id] = compiled

    def forget(self, seq_id: int) -> None:
        with self._lock:
            self._held.pop(seq_id, None)
            self._pending.pop(seq_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- used by a step -------------------------------------------------------------------
    def matcher(self, seq_id: int, guided: Guided) -> Any:
        """The matcher of a sequence's first step. Its grammar is here: the scheduler schedules
        a structured-output request only once its compile has been answered."""
        import xgrammar

        with self._lock:
            compiled = self._held.pop(seq_id, None)
        if compiled is None:
            compiled = self.lookup(guided)
        if compiled is None:
            # Never compiled here (that would stop every stream): a scheduler bug.
            raise RuntimeError(f"sequence {seq_id}: its grammar was never compiled")
        return xgrammar.GrammarMatcher(compiled)

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        import xgrammar

        return xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)

    # ---- the in-process engine ------------------------------------------------------------
    def compile_now(self, guided: Guided) -> Any:
        """Compile in this thread, through the LRU (the in-process engine: no other clients
        wait on it). Raises InvalidRequestError for a spec xgrammar refuses."""
        compiled = self.lookup(guided)
        if compiled is not None:
            return compiled
        import xgrammar

        if self._compiler is None:
            # The LRU is the cache: xgrammar's own would keep a second, unbounded copy.
            self._compiler = xgrammar.GrammarCompiler(
                self.tokenizer_info(), max_threads=2, cache_enabled=False
            )
        try:
            compiled = compile_guided(self._compiler, *guided)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad specs
            raise InvalidRequestError(
                f"invalid {guided[0]} constraint: {exc}", param="guided"
            ) from None
        self.insert(guided, compiled)
        return compiled
