"""Hostile bodies built and sent by client processes of their own, so that the event loop that
times the probe stream neither builds nor writes them (8 bodies of 3.5 MB each are a lot of a
client's work on the server's own cores). With `idle`, the senders post under SCHED_IDLE from
a session of their own whose scheduling group runs at nice 19: an attacker's CPU is not the
server's, and on one machine this is the nearest to a client elsewhere (its sends still cost
the server what receiving them costs). SCHED_IDLE alone ranks a process only within its
session's scheduling group (Linux's autogroups), and the server's processes are another."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection

import aiohttp

from shared.cpu_priority import run_when_idle
from tests.service import hostile_payloads as hp
from tests.service.hostile_client import post_to

START_TIMEOUT_S = 120.0  # spawning and importing takes seconds on a loaded machine


class ProcessSenders:
    """One spawned process per recipe: it builds its body, says it is ready and waits; each of
    `calls()` tells one to post its body and returns its answer (the dict `post` returns, its
    wall time measured in that process from the post to the answer)."""

    def __init__(self, url: str, recipes: list[hp.Recipe], idle: bool = False) -> None:
        # Spawned, not forked: the parent runs an event loop and threads (the RSS sampler).
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for recipe in recipes:
            ours, theirs = context.Pipe()
            proc = context.Process(target=_sender, args=(theirs, url, recipe, idle), daemon=True)
            self._conns.append(ours)
            self._procs.append(proc)

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every process has built its body: none of that falls in the row's time."""
        for proc in self._procs:
            proc.start()
        readies = [_receive(conn) for conn in self._conns]
        for ready in await asyncio.wait_for(asyncio.gather(*readies), timeout_s):
            if ready != "ready":
                raise RuntimeError(f"a sender process did not build its body: {ready}")

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    def calls(self) -> list[Callable[[], Awaitable[dict]]]:
        return [lambda conn=conn: _go(conn) for conn in self._conns]

    def close(self) -> None:
        """Ends the senders, those still waiting for an answer at a row's cap too."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc, conn in zip(self._procs, self._conns):
            proc.join(timeout=10.0)
            conn.close()


async def _go(conn: Connection) -> dict:
    conn.send("go")
    answer = await _receive(conn)
    if isinstance(answer, dict):
        return answer
    return {"path": None, "status": None, "wall_s": None, "detail": str(answer)[:160]}


async def _receive(conn: Connection) -> object:
    """The next message from a sender, awaited on the loop (no thread blocked on the pipe); the
    sender's exit reads as a string saying so."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(conn.fileno())
    try:
        return conn.recv()
    except EOFError:
        return "the sender process exited"


def _lowest_group_of_its_own() -> None:
    """A session of its own (so an autogroup of its own) at the lowest nice there is; where
    autogroups are off or absent this changes nothing that matters."""
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as group:
            group.write("19")
    except OSError:
        pass


def _sender(conn: Connection, url: str, recipe: hp.Recipe, idle: bool) -> None:
    asyncio.run(_send(conn, url, recipe, idle))


async def _send(conn: Connection, url: str, recipe: hp.Recipe, idle: bool) -> None:
    # Everything but the post itself before "ready": at the go this process only sends.
    call = recipe()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if idle:
            _lowest_group_of_its_own()
            run_when_idle()
        conn.send("ready")
        await _receive(conn)  # go
        conn.send(await post_to(session, url, call))
