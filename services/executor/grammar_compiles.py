"""The executor's compile thread: takes the scheduler's CompileGrammar requests, has each grammar
compiled on the worker process, keeps it in the GrammarStore and answers GrammarCompiled.

The step loop only hands requests over (a queue put), so no step ever waits for a compile. The
thread waits on the worker's pipe and for xgrammar's deserialisation on the loader thread, which
release the GIL (measured: the step loop's thread is never held up more than ~60 ms, with a 200
MB grammar). Every request is answered within its limit of its arrival, or about that: a 429
if it waited behind other compiles or for the worker's start, a 400 if its compile ran out.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from services.executor.grammar import GrammarStore
from services.executor.grammar_worker import (
    CompileCancelled,
    CompileFailed,
    CompilerStarting,
    CompilerUnavailable,
    CompileWorker,
)
from shared.cpu_priority import run_when_idle
from shared.protocol import CompileGrammar, GrammarCompiled

UNAVAILABLE = "service_unavailable_error"  # the server failed, not the spec: a 503
QUEUED_TOO_LONG = "rate_limit_error"  # others' compiles ran first: a 429, retry later

log = logging.getLogger("pagedserve.executor")


class GrammarCompiles:
    def __init__(
        self,
        store: GrammarStore,
        timeout_s: float,
        answer: Callable[[GrammarCompiled], None],
        steps: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        # The executor's count of launched steps: while it moves, compiles run in slices.
        self._steps = steps
        self.timeout_s = timeout_s
        self._answer = answer  # called on this thread only (its own socket: zmq's rule)
        # Each request with when it came: one still queued behind other compiles when its time
        # limit since then has passed is answered at once (429) instead of starting a compile
        # that may run the limit again; a compile itself is timed from its start.
        self._queue: queue.Queue[tuple[CompileGrammar, float] | None] = queue.Queue()
        self._closing = threading.Event()
        self.compiling = threading.Event()  # set while the worker runs a compile (for tests)
        self.worker: CompileWorker | None = None
        # Loading a compiled grammar is seconds of CPU for a big one (1.9 s for a 15,000-value
        # enum): on time the steps leave over, on a thread of its own. The compile thread
        # itself only waits and keeps time, at normal priority: under SCHED_IDLE on a busy
        # machine it could not even notice a deadline (a request waited 130 s for a 100 s limit).
        self.loader_thread_id: int | None = None
        self._loader = ThreadPoolExecutor(1, "grammar-load", initializer=self._loader_starts)
        self._thread = threading.Thread(target=self._run, name="grammar-compiles", daemon=True)
        self._thread.start()

    def submit(self, request: CompileGrammar) -> None:
        """From the step loop: never blocks."""
        self.store.expect(request.key, request.seq_ids)
        self._queue.put((request, time.monotonic()))

    def forget(self, seq_ids: list[int]) -> None:
        """From the step loop: these sequences' requests ended while waiting for their grammar.
        Their queued compiles are skipped, their held grammars dropped, and a compile running
        for them alone is killed (within POLL_S)."""
        for seq_id in seq_ids:
            self.store.forget(seq_id)

    def close(self) -> None:
        # The worker is closed by the compile thread alone (its Popen is that thread's): a
        # compile under way is cancelled, then the thread closes the worker and ends.
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self._loader.shutdown(wait=False, cancel_futures=True)

    def _loader_starts(self) -> None:
        run_when_idle(thread=True)
        self.loader_thread_id = threading.get_native_id()

    def _run(self) -> None:
        try:
            # Built now, at start-up: it is about a second of Python (the GIL held against the
            # step loop), which the first grammar request would otherwise cost every stream.
            info = self.store.tokenizer_info()
            # And the worker started now, importing at normal priority while no stream runs:
            # started by a first grammar request on a machine kept busy by streams, under
            # SCHED_IDLE it had barely run and was still importing when the request's limit
            # (100 s) had long passed.
            self.worker = CompileWorker(info.serialize_json(), self._steps)
            self.worker.start_soon(imports_first=True)
        except Exception:  # noqa: BLE001 - the first compile tries again and reports it
            log.exception("could not prepare the grammar compiler")
        try:
            while (item := self._queue.get()) is not None:
                request, submitted = item
                try:
                    self._serve(request, submitted + self.timeout_s)
                except Exception as exc:  # noqa: BLE001 - one failure must not stop others
                    log.exception("grammar compile %d failed", request.key)
                    self.store.hold(request.key, request.seq_ids, None)
                    error = f"the grammar compile failed: {exc}"
                    self._answer(GrammarCompiled(request.key, error, UNAVAILABLE))
        finally:
            if self.worker is not None:
                self.worker.close()

    def _serve(self, request: CompileGrammar, deadline: float) -> None:
        key, seq_ids = request.key, request.seq_ids
        if not self.store.wanted(key, seq_ids):
            return  # every sequence asking for it was freed meanwhile: nobody waits for it
        guided = (request.kind, request.spec)
        compiled = self.store.lookup(guided)
        if compiled is None:
            try:
                compiled = self._compile(request, deadline)
            except _NotCompiled as refused:
                self.store.hold(key, seq_ids, None)
                if refused.answer is not None:
                    self._answer(refused.answer)
                return
            self.store.insert(guided, compiled)
            _give_back_memory()
        self.store.hold(key, seq_ids, compiled)
        self._answer(GrammarCompiled(key))

    def _compile(self, request: CompileGrammar, deadline: float):  # -> xgrammar.CompiledGrammar
        """The request's grammar compiled on the worker and loaded; _NotCompiled with the
        answer saying why not (none when nobody waits for it any more)."""
        key, seq_ids = request.key, request.seq_ids
        if time.monotonic() >= deadline:
            why = f"the {request.kind} constraint waited for other grammars' compiles until"
            raise _NotCompiled(GrammarCompiled(key, self._past_limit(why), QUEUED_TOO_LONG))
        import xgrammar

        info = self.store.tokenizer_info()
        if self.worker is None:
            self.worker = CompileWorker(info.serialize_json(), self._steps)
        try:
            payload = self.worker.compile(
                request.kind,
                request.spec,
                self.timeout_s,
                deadline,
                # Every request for it aborted: stop it, its core is the steps' again.
                cancelled=lambda: self._closing.is_set() or not self.store.wanted(key, seq_ids),
                running=self.compiling,
            )
        except CompilerStarting:
            why = "the grammar compiler was still starting when"
            raise _NotCompiled(
                GrammarCompiled(key, self._past_limit(why), QUEUED_TOO_LONG)
            ) from None
        except CompileCancelled:
            raise _NotCompiled(None) from None
        except CompilerUnavailable as exc:
            raise _NotCompiled(GrammarCompiled(key, str(exc), UNAVAILABLE)) from None
        except CompileFailed as exc:
            raise _NotCompiled(GrammarCompiled(key, str(exc))) from None
        load = self._loader.submit(xgrammar.CompiledGrammar.deserialize_json, payload, info)
        del payload
        return load.result()

    def _past_limit(self, why: str) -> str:
        return (
            f"{why} this server's limit of {self.timeout_s:g} s (--grammar-compile-timeout) "
            "passed; retry later"
        )


class _NotCompiled(Exception):
    def __init__(self, answer: GrammarCompiled | None) -> None:
        super().__init__(answer)
        self.answer = answer  # None: nobody waits for it any more, nothing to say


def _give_back_memory() -> None:
    """Hand freed heap (a big grammar's JSON, evicted grammars) back to the OS: glibc keeps it
    otherwise, and the executor's RSS would only ever grow."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
