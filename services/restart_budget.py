"""How many times a dead process may be replaced: at most K restarts within a sliding window."""

from __future__ import annotations

import argparse
import time
from collections import deque

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 300.0


def add_restart_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault recovery")
    group.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="restarts of one dead process allowed within --restart-window; one more failure "
        "ends its requests with an error and stops the server (0: never restart)",
    )
    group.add_argument(
        "--restart-window",
        type=float,
        default=DEFAULT_RESTART_WINDOW_S,
        help="seconds over which --max-restarts is counted",
    )


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float) -> None:
        if max_restarts < 0 or window_s <= 0:
            raise ValueError("--max-restarts must be >= 0 and --restart-window > 0")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def allow(self, now: float | None = None) -> bool:
        """Take one restart if the window has room; False means give up."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def describe(self) -> str:
        return f"{self.max_restarts} restarts within {self.window_s:g} s"
