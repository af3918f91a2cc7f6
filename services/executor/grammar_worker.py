"""The grammar compile worker: a child process that compiles one grammar at a time, and the
executor's handle on it, which kills it when a compile overruns its time.

A process, not a thread: xgrammar cannot stop a compile midway, so only a kill gives back the
core and the memory of a compile that runs too long; and the memory a compile leaves behind is
given back by recycling the process. It runs at a lower priority than the executor's steps.
Frames on its pipes: an 8-byte little-endian length, then msgpack.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import msgpack

from shared.cpu_priority import run_at_nice

STARTUP_TIMEOUT_S = 300.0  # importing xgrammar (and torch) takes seconds on a loaded machine
RECYCLE_RSS_BYTES = 1 << 30  # a worker that grew past this is replaced after its compile
POLL_S = 0.1  # how soon a compile nobody waits for any more is stopped
# A compile nobody waits for any more is killed only once it has run this long: a younger one
# is likely done soon (and its grammar is cached for a retry), while a kill costs a new worker
# seconds of start-up, in which every other grammar request waits.
CANCEL_AFTER_S = 1.0
_HEADER = struct.Struct("<Q")
# The worker runs at nice 19: a compile takes little from the steps and still gets some CPU while
# they keep every core busy. Under SCHED_IDLE, with every service in one session (as the
# launcher starts them), a stream running all the time left it none: 0 of 20 grammars of
# 2,000-5,000 strings compiled in 300 s, against 19 at nice 19 (docs/reliability.md, "sixth
# round").
WORKER_NICE = 19
# While the executor launches steps, the worker runs in slices of RUN_SLICE_S and is stopped
# (SIGSTOP) for PAUSE_S between them: at most a tenth of a core, and never more than a slice at a
# time. At nice 19 alone it averaged a few percent of a core, but now and then the kernel let it
# run for 0.1-0.2 s of a core's time in a row, and each such burst was a gap of 0.2-0.9 s in
# every stream (a 50,000-value enum: docs/reliability.md, "seventh round"). With no step for
# BUSY_WINDOW_S it runs freely.
RUN_SLICE_S = 0.005
PAUSE_S = 0.045
BUSY_WINDOW_S = 0.1


class CompileFailed(Exception):
    """The spec does not compile, or its compile ran out of time (the message says which)."""


class CompilerUnavailable(CompileFailed):
    """The server's fault, not the spec's: the worker did not start, or crashed mid-compile."""


class CompilerStarting(Exception):
    """The worker is still starting (at nice 19 that takes long on a busy machine) and the
    request's time ran out first; it keeps starting for the requests after."""


class CompileCancelled(Exception):
    """Every request waiting for the compile went away: the worker was killed mid-compile."""


class CompileWorker:
    """Started on the first compile; restarted after a kill, a crash or a recycle."""

    def __init__(self, tokenizer_info_json: str, steps: Callable[[], int] | None = None) -> None:
        self._info_json = tokenizer_info_json
        self._steps = steps  # the executor's launched-step count; None: never paced
        self._proc: subprocess.Popen | None = None
        self._ready = False  # its "ready" frame was read
        self._started_at = 0.0
        self.num_started = 0
        self.num_killed = 0  # for overrunning their time
        self.num_cancelled = 0  # killed mid-compile: nobody waited for it any more

    def compile(
        self,
        kind: str,
        spec: str,
        timeout_s: float,
        deadline: float,  # monotonic: the request's own limit, start-up included
        cancelled: Callable[[], bool] = bool,
        running: threading.Event | None = None,
    ) -> str:
        """The compiled grammar as xgrammar's JSON (CompiledGrammar.serialize_json); `running`
        is set while the worker has it. The compile gets timeout_s from its start, and no
        more than `deadline` allows; CompilerStarting if the worker is not up by then."""
        proc = self._start(deadline)
        running = running or threading.Event()
        started = time.monotonic()
        end = min(started + timeout_s, deadline)

        def given_up() -> bool:
            return time.monotonic() - started >= CANCEL_AFTER_S and cancelled()

        try:
            _write(proc.stdin, [kind, spec])
            running.set()
            with self._paced(proc) as pace:
                reply = _read(proc.stdout, end, given_up, pace)
        except CompileCancelled:
            self.num_cancelled += 1
            self.close()
            raise
        except TimeoutError:
            self.num_killed += 1
            self.close()
            raise CompileFailed(
                f"compiling the {kind} constraint took longer than this server's limit of "
                f"{timeout_s:g} s (--grammar-compile-timeout)"
            ) from None
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise CompilerUnavailable(f"the grammar compiler failed: {exc}") from None
        finally:
            running.clear()
        ok, payload, rss = reply
        if rss > RECYCLE_RSS_BYTES:
            self.close()
        if not ok:
            raise CompileFailed(f"invalid {kind} constraint: {payload}")
        return payload

    @contextmanager
    def _paced(self, proc: subprocess.Popen) -> Iterator[_Pacer | None]:
        """The pacer for waiting on `proc` (None when never paced); on leaving, the worker is
        continued: it waits for its next compile on its stdin, not stopped. Not once it was
        closed meanwhile (a killed one's pid may be reused)."""
        pace = None if self._steps is None else _Pacer(proc.pid, self._steps)
        try:
            yield pace
        finally:
            if pace is not None and self._proc is proc:
                pace.resume()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None
            self._ready = False

    def start_soon(self, imports_first: bool = False) -> None:
        """Spawn the worker now without waiting for it: the next compile finds it up. With
        `imports_first` it starts up at the spawner's priority, then goes to nice 19: for the
        start with the executor, when no stream runs yet (at the lowest priority on a machine
        kept busy by streams its imports take minutes). A worker started again after a kill
        always starts at nice 19: those restarts are what an overlong grammar can make happen."""
        if self._proc is None or self._proc.poll() is not None:
            self._spawn(imports_first)

    def _start(self, deadline: float) -> subprocess.Popen:
        """The worker, started if need be and waited for until it is ready or `deadline`."""
        self.start_soon()
        proc = self._proc
        if not self._ready:
            give_up = self._started_at + STARTUP_TIMEOUT_S
            try:
                # A restart's imports may take bursts like a compile: paced too.
                with self._paced(proc) as pace:
                    _read(proc.stdout, min(give_up, deadline), pace=pace)
            except TimeoutError:
                if deadline < give_up:
                    raise CompilerStarting from None
                self.close()
                raise CompilerUnavailable("the grammar compiler did not start in time") from None
            except (OSError, EOFError, ValueError) as exc:
                self.close()
                raise CompilerUnavailable(f"the grammar compiler did not start: {exc!r}") from None
            self._ready = True
        return proc

    def _spawn(self, imports_first: bool = False) -> None:
        self.close()
        # It is killed with the executor (PR_SET_PDEATHSIG), and exits when its stdin closes.
        argv = [sys.executable, "-m", "services.executor.grammar_worker"]
        argv += ["--parent-pid", str(os.getpid())]
        argv += ["--imports-first"] if imports_first else []
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._proc = proc
        self._started_at = time.monotonic()
        self.num_started += 1
        # The tokenizer info fills the pipe until the worker, done importing, reads it: written
        # from a thread of its own, so that waiting for "ready" keeps to the request's deadline.
        # Nothing else is written before "ready", which comes after the worker read it all.
        threading.Thread(
            target=_write_quietly, args=(proc.stdin, self._info_json), daemon=True
        ).start()


def _write_quietly(pipe: BinaryIO, value: Any) -> None:
    """_write, for a worker that may be killed meanwhile: then its "ready" never comes."""
    try:
        _write(pipe, value)
    except (OSError, ValueError):
        pass


def _write(pipe: BinaryIO, value: Any) -> None:
    data = msgpack.packb(value)
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


class _Pacer:
    """Runs the worker in slices while steps run: continued for RUN_SLICE_S, stopped for
    PAUSE_S, on the thread that waits for its reply; continued whenever no step ran lately."""

    def __init__(self, pid: int, steps: Callable[[], int]) -> None:
        self._pid = pid
        self._steps = steps
        self._seen = steps()
        self._seen_at = time.monotonic()  # as if a step had just run: slices from the start
        self._stopped = False

    def wait(self, fd: int, timeout: float) -> bool:
        """Whether `fd` became readable within `timeout` (stopped at the end, if busy)."""
        self.resume()
        if not self._busy():
            return _readable(fd, timeout)
        if _readable(fd, min(timeout, RUN_SLICE_S)):
            return True
        self._signal(signal.SIGSTOP)
        self._stopped = True
        # A reply written before the stop is read now; one stopped midway, after the next slice.
        return _readable(fd, max(0.0, min(PAUSE_S, timeout - RUN_SLICE_S)))

    def resume(self) -> None:
        if self._stopped:
            self._signal(signal.SIGCONT)
            self._stopped = False

    def _busy(self) -> bool:
        now, count = time.monotonic(), self._steps()
        if count != self._seen:
            self._seen, self._seen_at = count, now
        return now - self._seen_at < BUSY_WINDOW_S

    def _signal(self, signum: int) -> None:
        try:
            os.kill(self._pid, signum)
        except ProcessLookupError:
            pass  # it died: the read sees the end of its pipe


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _read(
    pipe: BinaryIO,
    deadline: float | None = None,
    cancelled: Callable[[], bool] = bool,
    pace: _Pacer | None = None,
) -> Any:
    """One frame; TimeoutError when it is not all there by the deadline, CompileCancelled as
    soon as cancelled() says so; paced by `pace` while it waits."""
    fd = pipe.fileno()
    header = _read_exactly(fd, _HEADER.size, deadline, cancelled, pace)
    size = _HEADER.unpack(header)[0]
    return msgpack.unpackb(_read_exactly(fd, size, deadline, cancelled, pace))


def _read_exactly(
    fd: int,
    size: int,
    deadline: float | None,
    cancelled: Callable[[], bool],
    pace: _Pacer | None = None,
) -> bytes:
    chunks, left = [], size
    while left:
        while deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError
            timeout = min(wait, POLL_S)
            if pace.wait(fd, timeout) if pace is not None else _readable(fd, timeout):
                break
            if cancelled():
                raise CompileCancelled
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the grammar compiler exited")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---- the worker process -----------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _die_with_parent(parent: int | None) -> None:
    """Be killed with the executor, even mid-compile (EOF on stdin is only seen between
    compiles), and be the one the kernel's OOM killer picks rather than the executor."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the EOF on stdin still ends it, after its compile
    if parent is not None and os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # best effort


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.executor.grammar_worker")
    parser.add_argument("--parent-pid", type=int, default=None, help="the executor's pid")
    parser.add_argument("--imports-first", action="store_true", help="start up, then go to nice 19")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    if not args.imports_first:
        run_at_nice(WORKER_NICE)
    # Frames go to the pipe stdout was; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    source = sys.stdin.buffer
    import xgrammar

    from services.executor.grammar_spec import compile_guided

    info = xgrammar.TokenizerInfo.deserialize_json(_read(source))
    # No cache here: the executor keeps what it deserialized (its LRU), this process only builds.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write(out, "ready")
    run_at_nice(WORKER_NICE)  # ready: from here on at the lowest priority
    while True:
        try:
            kind, spec = _read(source)
        except EOFError:
            return 0
        try:
            reply = [True, compile_guided(compiler, kind, spec).serialize_json()]
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad specs
            reply = [False, str(exc) or type(exc).__name__]
        _write(out, [*reply, _rss_bytes()])


if __name__ == "__main__":
    sys.exit(main())
