"""The huge-body parser's process is started on a thread, not on the gateway's event loop: its
start starts a forkserver and waits for it, in which the loop would serve no stream."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

from services.gateway import input_work
from services.gateway.input_work import PARSE_IN_PROCESS_BYTES, InputWork


class _PoolOnThisProcess:
    """A ProcessPoolExecutor's calls, run here, each noting the thread it was called on."""

    calls: list[tuple[str, int]] = []

    def __init__(self, *args, **kwargs) -> None:
        self.calls.append(("start", threading.get_ident()))

    def submit(self, fn, *args) -> Future:
        self.calls.append((getattr(fn, "__name__", "?"), threading.get_ident()))
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, **kwargs) -> None:
        pass


async def test_the_parser_starts_on_a_thread_and_parses_for_the_loop(monkeypatch):
    monkeypatch.setattr(input_work, "ProcessPoolExecutor", _PoolOnThisProcess)
    monkeypatch.setattr(_PoolOnThisProcess, "calls", [])
    raw = json.dumps({"prompt": "x" * PARSE_IN_PROCESS_BYTES}).encode()
    work = InputWork()
    try:
        first = await work.parse(raw)
        second = await work.parse(raw)
    finally:
        work.close()
    assert first.value == second.value == json.loads(raw)
    loop_thread = threading.get_ident()
    names = [name for name, _ in _PoolOnThisProcess.calls]
    # Built once, its first process launched (the first submit) on a thread; then each parse.
    assert names == ["start", "int", "parse_bounded_json", "parse_bounded_json"]
    started = [thread for name, thread in _PoolOnThisProcess.calls if name in ("start", "int")]
    assert loop_thread not in started
