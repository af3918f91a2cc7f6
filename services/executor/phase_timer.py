"""Per-phase step timings that mean what they say on a GPU as well as on a CPU.

On a CPU the phases run synchronously and host clocks measure them. On a GPU the host only
enqueues work, so host clocks would charge every phase's device time to whichever one waits
first; CUDA events recorded between the phases measure the device's timeline instead, read
after the step's one synchronisation (no extra syncs).
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, phase_done: str) -> None:
        """The phase named `phase_done` ends here (and the next one begins)."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((phase_done, event))
        else:
            self._marks.append((phase_done, time.perf_counter()))

    def landed(self) -> bool:
        """The device has passed the last mark (on a CPU every mark is passed when made)."""
        return not self._cuda or self._marks[-1][1].query()

    def wait(self) -> None:
        """Until the device has passed the last mark: seconds() may then read every event."""
        if self._cuda:
            self._marks[-1][1].synchronize()

    def seconds(self) -> dict[str, float]:
        """{phase: seconds}; on a GPU call it after wait() (or a synchronisation)."""
        out = {}
        for (_, before), (name, after) in zip(self._marks, self._marks[1:]):
            if self._cuda:
                out[name] = before.elapsed_time(after) / 1000.0  # ms on the device's clock
            else:
                out[name] = after - before
        return out
