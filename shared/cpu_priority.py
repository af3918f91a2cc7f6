"""Background work that must not slow the model's steps: run it only on CPU time left over."""

from __future__ import annotations

import os
import threading


def run_when_idle(thread: bool = False) -> None:
    """Put this process (or, with `thread`, only the calling thread) under SCHED_IDLE.

    SCHED_IDLE runs it only when a core has nothing else to run: for short work that may wait
    (loading a compiled grammar). Work that must finish while the steps keep every core busy
    gets none here (run_at_nice). It ranks a task only within its session's scheduling group
    (Linux's autogroups). Linux schedules threads as tasks of their own, so a thread id works
    where a process id does.
    """
    target = threading.get_native_id() if thread else 0
    try:
        os.sched_setscheduler(target, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        if not thread:
            os.nice(19)  # not Linux: the lowest priority there is


def run_at_nice(nice: int, thread: bool = False) -> None:
    """Set this process's (or, with `thread`, only the calling thread's) nice value to `nice`.

    Work that must get some CPU while the steps keep every core busy (a request's body parse,
    refused with a 503 past its deadline) cannot run under SCHED_IDLE, which gives it none.
    Linux keeps a nice value per thread, and a process a thread starts takes that thread's.
    """
    target = threading.get_native_id() if thread else 0
    try:
        os.setpriority(os.PRIO_PROCESS, target, nice)
    except (AttributeError, OSError):
        pass  # no such call here, or not allowed: the default priority
