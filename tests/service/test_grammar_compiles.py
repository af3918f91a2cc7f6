"""The executor's grammars: an LRU bounded in bytes, grammars held for the sequences they were
compiled for, and compiles on a worker process that is killed when one overruns its time."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from services.executor.grammar import GrammarStore
from services.executor.grammar_compiles import GrammarCompiles
from services.executor.grammar_worker import WORKER_NICE
from shared.protocol import CompileGrammar, GrammarCompiled
from tests.support.polling import eventually_blocking

VOCAB = 384  # tests/factories.py's tiny model
EOS = (2,)


def enum_schema(tag: int, num_values: int = 100) -> tuple[str, str]:
    values = [f"{tag}-value-{i}" for i in range(num_values)]
    return ("json_schema", json.dumps({"enum": values}))


@pytest.fixture(scope="module")
def grammar_size(tiny_model_dir) -> int:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=1 << 30)
    return store.compile_now(enum_schema(0)).memory_size_bytes


def test_the_cache_stays_within_its_byte_limit_across_many_grammars(
    tiny_model_dir, grammar_size
) -> None:
    limit = int(3.5 * grammar_size)  # room for three of them
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=limit)
    for tag in range(20):
        store.compile_now(enum_schema(tag))
        assert store.cached_bytes <= limit
    assert store.num_cached == 3
    assert store.cached_bytes == sum(g.memory_size_bytes for g in store._lru.values())
    # Least recently used first out: the last three are kept.
    assert [store.lookup(enum_schema(t)) is not None for t in (16, 17, 18, 19)] == [
        False,
        True,
        True,
        True,
    ]


def test_a_grammar_bigger_than_the_cache_is_used_but_not_kept(tiny_model_dir) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=1)
    compiled = store.compile_now(enum_schema(1))
    store.expect(5, [40])
    store.hold(5, [40], compiled)
    assert store.num_cached == 0 and store.cached_bytes == 0
    assert store.matcher(40, enum_schema(1)) is not None  # held for its sequence
    assert store.num_held == 0  # ... until its matcher is made


def test_a_grammar_held_for_a_freed_sequence_is_dropped(tiny_model_dir) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=0)
    compiled = store.compile_now(enum_schema(2))
    store.expect(1, [7])
    store.hold(1, [7], compiled)
    store.forget(7)
    assert store.num_held == 0
    # Freed while its compile still ran: the compile is no longer wanted, nothing is held.
    store.expect(2, [8])
    store.forget(8)
    assert not store.wanted(2, [8])
    store.hold(2, [8], compiled)
    assert store.num_held == 0
    with pytest.raises(RuntimeError, match="never compiled"):
        store.matcher(8, enum_schema(2))


def warmed_up(
    store: GrammarStore, timeout_s: float
) -> tuple[GrammarCompiles, list[GrammarCompiled]]:
    """Compiles whose worker is up and has answered once (its start counts against a
    request's limit), with `timeout_s` from then on, and the list its answers go to."""
    answers: list[GrammarCompiled] = []
    compiles = GrammarCompiles(store, timeout_s=300.0, answer=answers.append)
    compiles.submit(CompileGrammar(0, "regex", "[x]", [0]))
    eventually_blocking(lambda: answers, timeout=300)
    compiles.forget([0])  # its grammar is held for nobody
    answers.clear()
    compiles.timeout_s = timeout_s
    return compiles, answers


def test_a_compile_past_its_limit_kills_the_worker_and_the_next_compile_works(
    tiny_model_dir,
) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=64 << 20)
    compiles, answers = warmed_up(store, timeout_s=1.0)
    try:
        slow = enum_schema(3, num_values=20000)  # ~4 s on one core for the tiny vocabulary
        small = ("regex", "[a-z]{1,5}")
        compiles.submit(CompileGrammar(1, *slow, [10]))
        eventually_blocking(lambda: answers, timeout=300)
        compiles.timeout_s = 300.0  # time for the new worker's start, which the kill costs
        compiles.submit(CompileGrammar(2, *small, [11]))
        eventually_blocking(lambda: len(answers) == 2, timeout=300)
        timed_out, ok = answers
        assert timed_out.key == 1 and "--grammar-compile-timeout" in timed_out.error
        assert ok == GrammarCompiled(2)
        assert compiles.worker.num_killed == 1 and compiles.worker.num_started == 2
        assert store.matcher(11, small) is not None
        assert store.lookup(slow) is None and store.num_held == 0
    finally:
        compiles.close()


def test_a_grammar_queued_behind_others_past_its_limit_is_a_429_without_a_compile(
    tiny_model_dir,
) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=64 << 20)
    compiles, answers = warmed_up(store, timeout_s=1.0)
    try:
        slow = enum_schema(5, num_values=20000)  # ~4 s: past the limit
        small = ("regex", "[a-z]{1,4}")  # would compile in a moment, but waits behind it
        compiles.submit(CompileGrammar(1, *slow, [30]))
        compiles.submit(CompileGrammar(2, *small, [31]))
        eventually_blocking(lambda: len(answers) == 2, timeout=300)
        timed_out, queued = answers
        assert timed_out.key == 1 and timed_out.error_type == "invalid_request_error"
        assert queued.key == 2 and queued.error_type == "rate_limit_error"
        assert "waited for other grammars" in queued.error
        assert compiles.worker.num_started == 1  # none started again for the queued one
        assert store.lookup(small) is None and store.num_held == 0
    finally:
        compiles.close()


def test_a_request_whose_limit_passes_while_the_worker_starts_is_a_429(tiny_model_dir) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=64 << 20)
    answers: list[GrammarCompiled] = []
    compiles = GrammarCompiles(store, timeout_s=300.0, answer=answers.append)
    try:
        # Spawned at start-up: the worker object exists a moment before its process does.
        eventually_blocking(
            lambda: compiles.worker is not None and compiles.worker.pid is not None, timeout=300
        )
        # That one imports at normal priority (no stream runs yet), then goes idle.
        assert "--imports-first" in compiles.worker._proc.args
        compiles.worker.close()  # as after a kill: the next compile starts another
        compiles.timeout_s = 0.3  # taken from the queue at once, but a start takes ~1 s
        small = ("regex", "[a-c]{1,3}")
        compiles.submit(CompileGrammar(1, *small, [40]))
        eventually_blocking(lambda: answers, timeout=300)
        [starting] = answers
        assert starting.error_type == "rate_limit_error" and "still starting" in starting.error
        compiles.timeout_s = 300.0  # the next request has time: the same worker, now up
        compiles.submit(CompileGrammar(2, *small, [41]))
        eventually_blocking(lambda: len(answers) == 2, timeout=300)
        assert answers[1] == GrammarCompiled(2)
        assert compiles.worker.num_started == 2  # at start-up, then once for both requests
        assert "--imports-first" not in compiles.worker._proc.args  # a restart starts idle
    finally:
        compiles.close()


def test_a_compile_nobody_waits_for_any_more_is_stopped(tiny_model_dir) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=64 << 20)
    answers: list[GrammarCompiled] = []
    one = threading.Event()

    def answer(message: GrammarCompiled) -> None:
        answers.append(message)
        one.set()

    compiles = GrammarCompiles(store, timeout_s=300.0, answer=answer)
    try:
        compiles.submit(CompileGrammar(1, *enum_schema(4, num_values=20000), [20]))
        # Its request is aborted once the worker has it (~4 s of compiling; an abort before
        # the thread takes it would only skip it, never reaching the kill).
        assert compiles.compiling.wait(300)
        compiles.forget([20])
        small = ("regex", "[0-9]{1,3}")
        compiles.submit(CompileGrammar(2, *small, [21]))
        assert one.wait(300)
        compiles.close()  # the queue drained: nothing more will be answered
        assert answers == [GrammarCompiled(2)]  # the slow one was neither finished nor answered
        assert compiles.worker.num_cancelled == 1 and compiles.worker.num_started == 2
        assert store.num_held == 1  # the small grammar, for sequence 21
        assert store.lookup(enum_schema(4, num_values=20000)) is None
    finally:
        compiles.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_compiles_run_at_the_lowest_nice_and_their_loading_on_idle_cpu_time(tiny_model_dir) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=64 << 20)
    done = threading.Event()
    compiles = GrammarCompiles(store, timeout_s=300.0, answer=lambda message: done.set())
    try:
        compiles.submit(CompileGrammar(1, "regex", "[a-z]{1,5}", [10]))
        assert done.wait(300)
        # Not SCHED_IDLE: in the server's one session that gave a compile no CPU while a stream ran.
        assert os.sched_getscheduler(compiles.worker.pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, compiles.worker.pid) == WORKER_NICE
        assert os.sched_getscheduler(compiles.loader_thread_id) == os.SCHED_IDLE
        # The compile thread only waits and keeps the deadlines: starved, it could not.
        assert os.sched_getscheduler(compiles._thread.native_id) != os.SCHED_IDLE
        assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the step loop's thread is not
    finally:
        compiles.close()


def _worker_state(pid: int) -> str | None:
    """R running, S sleeping, T stopped; None once it has exited (a worker grown past its
    limit is replaced after its compile)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_a_compile_runs_in_slices_while_steps_run_and_freely_when_none_does(
    tiny_model_dir,
) -> None:
    store = GrammarStore(tiny_model_dir, VOCAB, EOS, cache_bytes=64 << 20)
    steps = [0]
    stepping, done = threading.Event(), threading.Event()
    stepping.set()

    def step_loop() -> None:  # stands in for the executor's steps, one every 10 ms
        while not done.wait(0.01):
            steps[0] += stepping.is_set()

    threading.Thread(target=step_loop, daemon=True).start()
    answers: list[GrammarCompiled] = []
    compiles = GrammarCompiles(store, 300.0, answers.append, steps=lambda: steps[0])
    try:
        eventually_blocking(lambda: compiles.worker and compiles.worker.pid, timeout=300)
        slow = enum_schema(6, num_values=20000)  # ~4 s of one core unpaced
        compiles.submit(CompileGrammar(1, *slow, [50]))
        assert compiles.compiling.wait(300)
        pid = compiles.worker.pid
        seen = []
        end = time.monotonic() + 1.0
        while time.monotonic() < end and compiles.compiling.is_set():
            seen.append(_worker_state(pid))
            time.sleep(0.003)
        # Stopped between its slices: most of the time while steps run (a slice is 5 ms of 50).
        assert seen.count("T") > 0.5 * len(seen), seen
        assert "R" in seen or "S" in seen
        stepping.clear()  # no more steps: it runs on unstopped and finishes
        time.sleep(0.3)
        free = []
        while compiles.compiling.is_set():
            free.append(_worker_state(pid))
            time.sleep(0.003)
        assert free and "T" not in free
        eventually_blocking(lambda: answers, timeout=300)
        assert answers == [GrammarCompiled(1)]
        assert _worker_state(pid) != "T"  # left waiting for its next compile, not stopped
    finally:
        done.set()
        compiles.close()
