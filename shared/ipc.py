"""ZeroMQ sockets that carry protocol records: one PUSH/PULL pipe per direction, msgpack frames."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from shared.wire import decode, encode


@dataclass(frozen=True)
class Addresses:
    """The four one-way pipes; the scheduler binds all of them, the others connect."""

    requests: str  # gateway -> scheduler: GenerateRequest, AbortRequest, KvStateRequest
    deltas: str  # scheduler -> gateway: SchedulerReady, TokenDeltas, KvState
    plans: str  # scheduler -> executor: StepPlan, Shutdown
    results: str  # executor -> scheduler: ExecutorReady, StepResult

    @classmethod
    def ipc(cls, directory: str | None = None) -> Addresses:
        """ipc:// endpoints in a private directory (the default for one machine)."""
        directory = directory or tempfile.mkdtemp(prefix="pagedserve-")
        os.makedirs(directory, exist_ok=True)
        return cls(
            *(f"ipc://{directory}/{name}" for name in ("requests", "deltas", "plans", "results"))
        )


def default_addresses() -> Addresses:
    """Fixed per-user ipc:// endpoints, so services started one by one find each other."""
    return Addresses.ipc(os.path.join(tempfile.gettempdir(), f"pagedserve-{os.getuid()}"))


def add_address_args(parser) -> None:
    group = parser.add_argument_group("ZeroMQ endpoints (ipc:// on one machine, tcp:// across)")
    defaults = default_addresses()
    for name in ("requests", "deltas", "plans", "results"):
        group.add_argument(
            f"--{name}-addr", default=getattr(defaults, name), help=f"the {name} pipe"
        )


def addresses_from_args(args) -> Addresses:
    return Addresses(args.requests_addr, args.deltas_addr, args.plans_addr, args.results_addr)


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never hang at exit on undelivered messages
    if kind == zmq.PUSH:
        # Never drop or block on a slow peer: the pipes carry at most one plan or one step's
        # deltas at a time, so unbounded queues stay small.
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        if address.startswith("ipc://"):
            os.makedirs(os.path.dirname(address[len("ipc://") :]), exist_ok=True)
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


async def send(sock: zmq.asyncio.Socket, message: Any) -> None:
    await sock.send(encode(message), copy=False)


async def recv(sock: zmq.asyncio.Socket) -> Any:
    return decode(await sock.recv(copy=True))


def send_sync(sock: zmq.Socket, message: Any) -> None:
    sock.send(encode(message), copy=False)


def recv_sync(sock: zmq.Socket, timeout_ms: int | None = None) -> Any | None:
    """The next message, or None when timeout_ms passes first."""
    if timeout_ms is not None and not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return decode(sock.recv(copy=True))
