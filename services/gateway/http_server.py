"""Serve the gateway app until SIGTERM or SIGINT, with the connection limits of ConnectionGuard.

This is web.run_app's job, done here because run_app builds its listening site itself and offers
no way to wrap the protocol factory that the connection cap and the head timer need.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass

import uvloop
from aiohttp import web

from services.gateway.connection_guard import ConnectionGuard

SHUTDOWN_TIMEOUT_S = 5.0  # open streams get their terminal event first (on_shutdown)


@dataclass(frozen=True)
class ConnectionLimits:
    header_read_timeout_s: float = 10.0  # a request head, from its first byte (or the connect)
    keepalive_timeout_s: float = 15.0  # no complete head this long after the last response
    max_connections: int = 1024  # per gateway process; more are answered 503 and closed


def run(
    app: web.Application,
    *,
    host: str,
    port: int,
    reuse_port: bool,
    limits: ConnectionLimits,
    on_refused: Callable[[], None] = lambda: None,
    on_listening: Callable[[int], None] = lambda port: None,
) -> None:
    """on_listening gets the bound port once the socket listens (the kernel's pick for port 0)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(app, host, port, reuse_port, limits, on_refused, on_listening))


def make_runner(app: web.Application, limits: ConnectionLimits) -> web.AppRunner:
    return web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,  # a client that leaves cancels its handler, which aborts
        keepalive_timeout=limits.keepalive_timeout_s,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


async def listen(
    runner: web.AppRunner,
    host: str,
    port: int,
    *,
    reuse_port: bool,
    limits: ConnectionLimits,
    on_refused: Callable[[], None] = lambda: None,
) -> ConnectionGuard:
    """Bind host:port for a runner that is set up; its cleanup() stops listening first."""
    site = _GuardedSite(runner, host, port, reuse_port, limits, on_refused)
    await site.start()
    assert site.guard is not None
    return site.guard


async def _serve(
    app: web.Application,
    host: str,
    port: int,
    reuse_port: bool,
    limits: ConnectionLimits,
    on_refused: Callable[[], None],
    on_listening: Callable[[int], None],
) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Cancelling works during start-up too, which can wait long for the backend.
        loop.add_signal_handler(signum, main.cancel)
    runner = make_runner(app, limits)
    try:
        await runner.setup()  # the start-up handlers run here, before the port is bound
        await listen(
            runner, host, port, reuse_port=reuse_port, limits=limits, on_refused=on_refused
        )
        on_listening(runner.addresses[0][1])  # (host, port) or IPv6's (host, port, flow, scope)
        await asyncio.Future()  # until a signal cancels this task
    except asyncio.CancelledError:
        pass  # the signal: shut down in order below
    finally:
        await runner.cleanup()  # stops the site, ends streams, closes connections, the backend


class _GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a ConnectionGuard."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        reuse_port: bool,
        limits: ConnectionLimits,
        on_refused: Callable[[], None],
    ) -> None:
        super().__init__(runner)
        self._host, self._port, self._reuse_port = host, port, reuse_port
        self._limits, self._on_refused = limits, on_refused
        self.guard: ConnectionGuard | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()  # registers with the runner, whose cleanup() stops this site
        assert self._runner.server is not None
        self.guard = ConnectionGuard(
            self._runner.server,
            max_connections=self._limits.max_connections,
            header_read_timeout_s=self._limits.header_read_timeout_s,
            on_refused=self._on_refused,
        )
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard, self._host, self._port, backlog=self._backlog, reuse_port=self._reuse_port
        )
