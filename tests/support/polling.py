"""The one way tests wait for something another task, thread or process makes true."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

_NOT_YET = object()


async def eventually(
    condition: Callable[[], Any],
    timeout: float = 5.0,
    interval: float = 0.01,
    message: str | Callable[[], str] = "condition never became true",
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call `condition` (plain or async) every `interval` s until it returns a truthy value,
    which is returned; fail after `timeout` s with `message` and the last value seen.

    `ignore`: exceptions that mean "not yet" (a server that is still starting), not a failure.
    `message` may be a function, called only on failure to describe the state then.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = _NOT_YET
    while True:
        try:
            last = condition()
            if inspect.isawaitable(last):
                last = await last
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        assert loop.time() < deadline, _failure(message, timeout, last)
        await asyncio.sleep(interval)


def eventually_blocking(
    condition: Callable[[], Any],
    timeout: float = 5.0,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition never became true",
) -> Any:
    """eventually() for code without an event loop: sleeps the calling thread in between."""
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last:
            return last
        assert time.monotonic() < deadline, _failure(message, timeout, last)
        time.sleep(interval)


def _failure(message: str | Callable[[], str], timeout: float, last: Any) -> str:
    text = message() if callable(message) else message
    return f"{text} within {timeout} s (last: {last!r})"
