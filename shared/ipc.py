"""ZeroMQ sockets that carry protocol records as msgpack frames.

Scheduler <-> executor: one PUSH/PULL pipe per direction. Gateways <-> scheduler: one ROUTER
socket at the scheduler and a DEALER per gateway, so several gateway processes can share one
scheduler: the ROUTER knows which gateway sent each request and sends each its own deltas.
"""

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
    """The scheduler's three endpoints; the scheduler binds all of them, the others connect."""

    # gateways <-> scheduler, both ways: GenerateRequest, AbortRequest, KvStateRequest,
    # GatewayHello up; SchedulerReady, TokenDeltas, KvState down
    gateway: str
    plans: str  # scheduler -> executor: StepPlan, Shutdown
    results: str  # executor -> scheduler: ExecutorReady, StepResult

    @classmethod
    def ipc(cls, directory: str | None = None) -> Addresses:
        """ipc:// endpoints in a private directory (the default for one machine)."""
        directory = directory or tempfile.mkdtemp(prefix="pagedserve-")
        os.makedirs(directory, exist_ok=True)
        return cls(*(f"ipc://{directory}/{name}" for name in ("gateway", "plans", "results")))


def default_addresses() -> Addresses:
    """Fixed per-user ipc:// endpoints, so services started one by one find each other."""
    return Addresses.ipc(os.path.join(tempfile.gettempdir(), f"pagedserve-{os.getuid()}"))


def add_address_args(parser) -> None:
    group = parser.add_argument_group("ZeroMQ endpoints (ipc:// on one machine, tcp:// across)")
    defaults = default_addresses()
    for name in ("gateway", "plans", "results"):
        group.add_argument(
            f"--{name}-addr", default=getattr(defaults, name), help=f"the {name} pipe"
        )


def addresses_from_args(args) -> Addresses:
    return Addresses(args.gateway_addr, args.plans_addr, args.results_addr)


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never hang at exit on undelivered messages
    # Never drop or block on a slow peer: the pipes carry at most one plan or one step's
    # deltas at a time, so unbounded queues stay small.
    if kind in (zmq.PUSH, zmq.ROUTER, zmq.DEALER):
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind in (zmq.PULL, zmq.ROUTER, zmq.DEALER):
        sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.ROUTER:
        # A message to a peer that is gone raises (EHOSTUNREACH) instead of vanishing: that is
        # how the scheduler learns which gateway left.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if address.startswith("tcp://"):
        # Across machines a dead host closes no connection: ZMTP heartbeats (answered by zmq's
        # own thread, so a busy peer still answers) end a silent one, and the peer watches
        # see the loss as they see a process's exit.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)
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


async def send_to(sock: zmq.asyncio.Socket, peer: bytes, message: Any) -> bool:
    """Send to one peer of a ROUTER socket; False when that peer is no longer connected."""
    try:
        await sock.send_multipart([peer, encode(message)], copy=False)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


async def recv_from(sock: zmq.asyncio.Socket) -> tuple[bytes, Any]:
    """(the sending peer, its message) from a ROUTER socket; WireError for a malformed one."""
    peer, data = await sock.recv_multipart(copy=True)
    return peer, decode(data)


def send_sync(sock: zmq.Socket, message: Any) -> None:
    sock.send(encode(message), copy=False)


def recv_sync(sock: zmq.Socket, timeout_ms: int | None = None) -> Any | None:
    """The next message, or None when timeout_ms passes first."""
    if timeout_ms is not None and not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return decode(sock.recv(copy=True))
