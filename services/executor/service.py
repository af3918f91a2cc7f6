"""The executor process: announce the pool, then run each plan that arrives, return its result."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import torch
import zmq

from services.config_args import add_config_json_arg, add_engine_args, engine_config_from_args
from services.executor.factory import make_executor
from services.executor.quantize_model import weight_bytes
from shared.heap import freeze_startup_heap
from shared.ipc import add_address_args, addresses_from_args, make_socket, recv_sync, send_sync
from shared.protocol import (
    CompileGrammar,
    ExecutorHeartbeat,
    ForgetGrammars,
    GrammarCompiled,
    Shutdown,
    StepPlan,
)

log = logging.getLogger("pagedserve.executor")
HEARTBEAT_S = 1.0
LANDED_POLL_S = 50e-6  # between checks for a plan or the step's end: a fraction of any step


def serve(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    executor = make_executor(config, served=True)
    ctx = zmq.Context()
    addresses = addresses_from_args(args)
    plans = make_socket(ctx, zmq.PULL, addresses.plans, bind=False)
    results = make_socket(ctx, zmq.PUSH, addresses.results, bind=False)
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat, args=(ctx, addresses.results, stop), name="heartbeat", daemon=True
    )
    beat.start()
    grammars = _GrammarAnswers(ctx, addresses.results, executor, config)
    send_sync(results, executor.ready())
    freeze_startup_heap()
    log.info("executor ready: %s", executor.ready())
    if config.executor != "sim":
        log.info(
            "weights: %s, %.1f MB, %d torch threads",
            executor.quantization,
            weight_bytes(executor.model) / 1e6,
            torch.get_num_threads(),
        )
    # SIGTERM (the launcher's stop) unwinds through `finally`, which stops the other TP ranks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    flight = None  # the last launched step, its result not sent yet
    try:
        while True:
            if flight is not None:
                # A plan that arrives while this step runs (async scheduling planned it
                # ahead) is launched behind it before its samples are read, so the device
                # goes on without waiting for the host.
                message = _plan_or_landed(plans, flight)
                if message is None:
                    send_sync(results, executor.collect(flight))
                    flight = None
                    continue
            else:
                message = recv_sync(plans, timeout_ms=1000)
            if not executor.ranks_alive():
                log.error("a tensor-parallel rank has exited; the executor cannot go on")
                return 1
            if message is None:
                if _orphaned(args.parent_pid):
                    log.warning("parent process is gone; exiting")
                    return 1
                if not executor.ranks_alive():
                    log.error("a tensor-parallel rank has exited; exiting so that all restart")
                    return 1
                continue
            if isinstance(message, Shutdown):
                executor.close()
                return 0
            if isinstance(message, CompileGrammar):
                # Never here, in the step loop: the compile thread answers when it is done.
                grammars.submit(message, results)
                continue
            if isinstance(message, ForgetGrammars):
                grammars.forget(message.seq_ids)
                continue
            if isinstance(message, StepPlan):
                launched = executor.launch(message)
                if flight is not None:
                    send_sync(results, executor.collect(flight))
                flight = launched
                if not executor.ranks_alive():
                    # A dead rank is this executor's death: exit instead of failing requests, so
                    # the launcher starts a new executor and the scheduler recomputes them there.
                    log.error("a tensor-parallel rank has exited; exiting so that all restart")
                    return 1
    finally:
        stop.set()
        grammars.close()
        executor.close()
        ctx.destroy(linger=0)


def _plan_or_landed(plans: zmq.Socket, flight) -> object | None:
    """The next message if one arrives before the flight's samples have landed, else None.

    Landed is checked first: a step already done (on a CPU, every step at the end of its
    launch) is answered at once, so its tokens are never held back behind the next step."""
    while True:
        if flight.landed():
            return None
        if plans.poll(0, zmq.POLLIN):
            return recv_sync(plans)
        time.sleep(LANDED_POLL_S)


class _GrammarAnswers:
    """CompileGrammar requests: compiled on their own thread, answered on its own socket
    (zmq sockets are not thread-safe); the simulator has no grammars and says ready at once."""

    def __init__(self, ctx: zmq.Context, address: str, executor, config) -> None:
        self._ctx, self._address = ctx, address
        self._compiles = None
        self._socket = None
        if config.executor != "sim":
            from services.executor.grammar_compiles import GrammarCompiles

            timeout = config.grammar.compile_timeout_s
            self._compiles = GrammarCompiles(
                executor.grammars, timeout, self._answer, steps=lambda: executor.num_launched
            )

    def submit(self, request: CompileGrammar, results: zmq.Socket) -> None:
        """From the step loop, whose socket `results` is."""
        if self._compiles is None:
            send_sync(results, GrammarCompiled(request.key))
        else:
            self._compiles.submit(request)

    def forget(self, seq_ids: list[int]) -> None:
        if self._compiles is not None:
            self._compiles.forget(seq_ids)

    def _answer(self, message: GrammarCompiled) -> None:
        if self._socket is None:  # made on the compile thread, the only one sending on it
            self._socket = make_socket(self._ctx, zmq.PUSH, self._address, bind=False)
        send_sync(self._socket, message)

    def close(self) -> None:
        if self._compiles is not None:
            self._compiles.close()


def _heartbeat(ctx: zmq.Context, address: str, stop: threading.Event) -> None:
    # Its own socket: zmq sockets are not thread-safe. torch releases the GIL in its kernels,
    # so this thread keeps beating through long forward passes.
    sock = make_socket(ctx, zmq.PUSH, address, bind=False)
    try:
        while not stop.wait(HEARTBEAT_S):
            send_sync(sock, ExecutorHeartbeat(os.getpid()))
    except zmq.ContextTerminated:
        pass
    finally:
        sock.close(linger=0)


def _orphaned(parent_pid: int | None) -> bool:
    return parent_pid is not None and os.getppid() != parent_pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.executor")
    add_engine_args(parser)
    add_config_json_arg(parser)
    add_address_args(parser)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this one exits")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve(args)
