"""The gateway process: the HTTP app on uvloop, wired to the scheduler over ZeroMQ."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import logging
import os
import signal

from aiohttp import web

from services.gateway.http_server import ConnectionLimits, run
from services.gateway.prompts import DEFAULT_MAX_CHAT_MESSAGES
from services.gateway.replicas import ReplicaRouter
from services.gateway.request_body import DEFAULT_BODY_READ_TIMEOUT_S
from services.gateway.tool_parsers import PARSERS
from services.gateway.zmq_backend import ZmqBackend
from shared.ipc import add_address_args, addresses_from_args
from shared.model_source import resolve_model

log = logging.getLogger("pagedserve.gateway")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument(
        "--port",
        type=int,
        default=8000,
        help="0: a free port the kernel picks, reported once bound (serve: in the url of its "
        "'pagedserve: ready' line; the gateway process: in --port-file), so that no other "
        "process can take it between a pick and the bind",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY, which keeps the "
        "key out of ps and /proc/PID/cmdline, where any local user reads a flag's value)",
    )
    group.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without an API key on a --host other machines can reach (refused otherwise)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 429 while this many requests wait for admission",
    )
    group.add_argument(
        "--max-chat-messages",
        type=int,
        default=DEFAULT_MAX_CHAT_MESSAGES,
        help="refuse (400) a chat request with more messages than this, before rendering it",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take from arrival to its last token; then it ends with a "
        "timeout error (HTTP 408, or an error event on a stream) and its KV blocks are freed",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how tool calls are read from chat replies (default: the format the chat template "
        "writes where that is unambiguous, else hermes, which the fallback tool prompt teaches)",
    )
    limits = ConnectionLimits()
    group.add_argument(
        "--body-read-timeout",
        type=_positive_float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds a request body may take to arrive in full; then HTTP 408",
    )
    group.add_argument(
        "--header-read-timeout",
        type=_positive_float,
        default=limits.header_read_timeout_s,
        help="seconds a request head may take, from the connection's start or the head's "
        "first byte; then the connection is closed (a head sent a byte at a time)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=_positive_float,
        default=limits.keepalive_timeout_s,
        help="close a connection without a complete request head this many seconds after "
        "its previous response (or its start)",
    )
    group.add_argument(
        "--max-connections",
        type=_positive_int,
        default=limits.max_connections,
        help="open HTTP connections per gateway process; more are answered 503 and closed at once",
    )


def check_exposure(args: argparse.Namespace) -> None:
    """Refuse to serve without an API key on an address that other machines can reach."""
    if args.api_key or args.allow_unauthenticated or _is_loopback(args.host):
        return
    raise ValueError(
        f"--host {args.host!r} is reachable from other machines and no API key is set: pass "
        "--api-key KEY (or set PAGEDSERVE_API_KEY), or --allow-unauthenticated to serve "
        "anyone who can reach it"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "" (every address): it may be reachable
        return False


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway")
    parser.add_argument("--model", default=None, help="model directory (for the tokenizer)")
    add_gateway_args(parser)
    add_address_args(parser)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this one exits")
    parser.add_argument(
        "--replica-addr",
        action="append",
        default=[],
        metavar="GATEWAY_ADDR",
        help="a further scheduler's gateway endpoint (a replica) to route requests to; repeat "
        "for more",
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="share the port with other gateway processes (SO_REUSEPORT: the kernel spreads "
        "connections across them); such a gateway starts listening only once its backend "
        "is ready",
    )
    parser.add_argument(
        "--ready-file", default=None, help="create this file once the gateway can serve"
    )
    parser.add_argument(
        "--port-file", default=None, help="write the bound port to this file once listening"
    )
    parser.add_argument(
        "--placement-file",
        default=None,
        help="serve --ray-address: the launcher's file of replica placements, for /metrics",
    )
    args = parser.parse_args(argv)
    try:
        check_exposure(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from transformers import AutoTokenizer

    from services.gateway.app import STATE, create_app
    from shared.heap import freeze_startup_heap

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model), local_files_only=True)
    backend = _backend(args)
    app = create_app(
        backend,
        tokenizer,
        api_key=args.api_key or None,  # an empty key means no key
        max_queued_requests=args.max_queued_requests,
        max_chat_messages=args.max_chat_messages,
        request_timeout_s=args.request_timeout,
        body_read_timeout_s=args.body_read_timeout,
    )
    app[STATE].tool_call_parser = args.tool_call_parser
    if args.placement_file:
        from services.gateway.placement_metrics import PlacementCollector

        app[STATE].metrics.add_live(PlacementCollector(args.placement_file))

    async def start_backend(app: web.Application) -> None:
        await backend.start()
        freeze_startup_heap()
        if args.parent_pid is not None:
            app["orphan_watch"] = asyncio.create_task(_exit_when_orphaned(args.parent_pid))
        if args.reuse_port:
            # The kernel hands a listening process its share of new connections: one that is
            # still starting would answer them 503 while its siblings could serve them.
            while not backend.ready:
                await asyncio.sleep(0.1)
        if args.ready_file:
            # The site binds right after the start-up handlers; /health confirms it.
            open(args.ready_file, "w").close()

    async def end_streams(app: web.Application) -> None:
        backend.fail_all("the server is shutting down")

    async def stop_backend(app: web.Application) -> None:
        await backend.close()

    app.on_startup.append(start_backend)
    app.on_shutdown.append(end_streams)
    app.on_cleanup.append(stop_backend)
    limits = ConnectionLimits(
        header_read_timeout_s=args.header_read_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        max_connections=args.max_connections,
    )
    run(
        app,
        host=args.host,
        port=args.port,
        reuse_port=args.reuse_port,
        limits=limits,
        on_refused=app[STATE].metrics.connections_refused.inc,
        on_listening=functools.partial(_report_port, args.port_file),
    )
    return 0


def _report_port(port_file: str | None, port: int) -> None:
    log.info("listening on port %d", port)
    if port_file:
        # Renamed into place whole: a reader polling for the file never sees half of it.
        with open(f"{port_file}.tmp", "w") as f:
            f.write(f"{port}\n")
        os.replace(f"{port_file}.tmp", port_file)


def _backend(args: argparse.Namespace) -> ZmqBackend | ReplicaRouter:
    primary = addresses_from_args(args)
    if not args.replica_addr:
        return ZmqBackend(primary)
    replicas = [ZmqBackend(primary)]
    for address in args.replica_addr:
        # Only the gateway endpoint matters here; the replica's own plan pipes are its own.
        replicas.append(ZmqBackend(dataclasses.replace(primary, gateway=address)))
    return ReplicaRouter(replicas)


async def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("parent process is gone; shutting down")
    os.kill(os.getpid(), signal.SIGTERM)
