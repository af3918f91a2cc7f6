"""Resident memory of a stack's processes: read now, sampled over a run, and plotted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass  # the process is gone (killed, or being replaced)
    return 0.0


def children(pid: int) -> list[int]:
    """Every descendant of a process (e.g. the executor's grammar compiler)."""
    found = []
    # Each thread lists the children it started, so every thread's file is read.
    for children_file in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children_file.read_text().split()]
        except OSError:
            pass  # the thread or the process is gone
    return found + [d for c in found for d in children(c)]


def rss_now(pids: dict[str, int]) -> dict[str, float]:
    """Each process's RSS, and the sum over its descendants as `<name>_children` where it has
    any (their memory is the process's doing but not in its own RSS)."""
    out = {}
    for name, pid in sorted(pids.items()):
        out[name] = round(rss_mib(pid), 1)
        if descendants := children(pid):
            out[f"{name}_children"] = round(sum(rss_mib(d) for d in descendants), 1)
    return out


class RssSampler:
    """A thread reading every process's RSS each `tick_s`: peaks from every read, and one sample
    kept every `keep_every_s` (the pids are re-read each tick, so restarts are followed)."""

    def __init__(
        self, pids: Callable[[], dict[str, int]], tick_s: float = 0.5, keep_every_s: float = 5.0
    ) -> None:
        self._pids = pids
        self._tick_s = tick_s
        self._keep_every_s = keep_every_s
        self.t0 = time.monotonic()
        self.peak: dict[str, float] = {}
        self.samples: list[dict[str, float]] = []  # {"minutes": m, name: MiB, ...}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset_peak(self) -> None:
        self.peak = {}

    def _run(self) -> None:
        last_kept = -self._keep_every_s
        while not self._stop.wait(self._tick_s):
            now = rss_now(dict(self._pids()))
            for name, mib in now.items():
                self.peak[name] = max(self.peak.get(name, 0.0), mib)
            elapsed = time.monotonic() - self.t0
            if elapsed - last_kept >= self._keep_every_s:
                last_kept = elapsed
                self.samples.append({"minutes": round(elapsed / 60, 3), **now})


def plot_rss(samples: list[dict[str, float]], path: str, title: str) -> None:
    """One line per process: RSS (MiB) against minutes into the run."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = sorted({k for s in samples for k in s if k != "minutes"})
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in names:
        points = [(s["minutes"], s[name]) for s in samples if name in s]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
