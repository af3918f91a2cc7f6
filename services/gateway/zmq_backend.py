"""The Backend over ZeroMQ: requests and aborts to the scheduler, its deltas routed per request.

One DEALER socket carries both directions; the scheduler's ROUTER tells this gateway's
connection from other gateways' and sends it only the deltas of requests it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from services.gateway.backend import BackendGone
from services.gateway.kv_state import KvStateCache
from shared.ipc import Addresses, make_socket, recv, send
from shared.peer_watch import PeerWatch
from shared.protocol import (
    AbortRequest,
    GatewayHello,
    GenerateRequest,
    KvState,
    KvStateRequest,
    RequestDelta,
    SchedulerReady,
    SchedulerStats,
    SeqDelta,
    TokenDeltas,
)

log = logging.getLogger("pagedserve.gateway")
LIVENESS_CHECK_S = 1.0
DRAIN_MAX = 64  # messages read at one wake-up of the reader
_FAILED = ("abort", "error")  # sample finish reasons the gateway raises at
HEARTBEAT_TIMEOUT_S = 5.0  # the scheduler beats every second; five missed beats mean it is gone


class ZmqBackend:
    def __init__(self, addresses: Addresses, stats_log: list[SchedulerStats] | None = None) -> None:
        self.addresses = addresses
        self.stats_log = stats_log  # when given, every stats message is appended (benchmarks)
        self._info: SchedulerReady | None = None
        self._stats: SchedulerStats | None = None
        self._last_seen = 0.0
        self._queues: dict[str, asyncio.Queue[RequestDelta | BackendGone]] = {}
        # Sent but not yet acknowledged: the scheduler's num_waiting does not count these yet.
        # Dropped in the same reader step that takes the stats carrying their ack, so a request
        # is never counted twice (in transit and waiting) nor not at all.
        self._unacked: set[str] = set()
        self._reader: asyncio.Task | None = None
        self._kv_states = KvStateCache(self._request_kv_state)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, self.addresses.gateway, bind=False)
        self._send_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._reader = asyncio.create_task(self._read())
        self._watch_peers = PeerWatch(
            self._sock, self._on_scheduler_lost, self._on_scheduler_joined
        )
        self._watch = asyncio.create_task(self._watch_peers.run())
        self._liveness = asyncio.create_task(self._watch_liveness())
        # Queued until connected. The join event says hello again after every reconnection
        # (a restarted scheduler), and also now, unless the connection beat the monitor.
        await self._send(GatewayHello())

    async def close(self) -> None:
        for task in (self._reader, getattr(self, "_watch", None), getattr(self, "_liveness", None)):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._ctx.destroy(linger=0)

    @property
    def alive(self) -> bool:
        return self._info is not None and time.monotonic() - self._last_seen < HEARTBEAT_TIMEOUT_S

    @property
    def ready(self) -> bool:
        return self.alive and (self._stats is None or self._stats.executor_alive)

    @property
    def degraded(self) -> bool:
        """The scheduler is up but replacing a dead executor: requests wait, none is lost."""
        return self.alive and self._stats is not None and self._stats.executor_restarting

    @property
    def info(self) -> SchedulerReady | None:
        return self._info

    @property
    def stats(self) -> SchedulerStats | None:
        return self._stats

    @property
    def num_in_transit(self) -> int:
        return len(self._unacked)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        queue: asyncio.Queue[RequestDelta | BackendGone] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._unacked.add(request.request_id)
        try:
            await self._send(request)
            while True:
                # No timeout per token (this runs once per token of every stream): a dead or
                # silent backend ends the streams through _watch_liveness and _on_scheduler_lost.
                items = [await queue.get()]
                while not queue.empty():  # fell behind: what has queued goes out as one
                    items.append(queue.get_nowait())
                for delta in coalesce(items):
                    if isinstance(delta, BackendGone):
                        raise delta
                    yield delta
                    if delta.finished:
                        return
        finally:
            self._queues.pop(request.request_id, None)
            self._unacked.discard(request.request_id)

    def fail_all(self, reason: str) -> None:
        """End every open stream with BackendGone (shutdown, or the backend is gone)."""
        for queue in self._queues.values():
            queue.put_nowait(BackendGone(reason))

    async def _watch_liveness(self) -> None:
        """Once a second: while the backend is neither ready nor replacing its executor (its
        heartbeat stopped, or its executor is dead for good), end every open stream. While no
        heartbeat comes, say hello again: a scheduler that lost track of this gateway (or
        never heard its first hello) takes it back."""
        while True:
            await asyncio.sleep(LIVENESS_CHECK_S)
            if self._queues and not (self.ready or self.degraded):
                log.error("the backend stopped responding; ending %d streams", len(self._queues))
                self.fail_all("the scheduler or executor stopped responding")
            if not self.alive and self._watch_peers.num_peers > 0:
                # Only while connected: hellos sent into a closed connection would queue up
                # and all arrive at once (a reconnection says hello by itself).
                await self._send(GatewayHello())

    def _on_scheduler_joined(self) -> None:
        task = asyncio.ensure_future(self._send(GatewayHello()))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_scheduler_lost(self) -> None:
        # Its requests died with it: end their streams now rather than after missed heartbeats,
        # and answer 503 until a new scheduler announces itself.
        if self._info is None:
            return
        log.error("the scheduler's connection closed; ending %d streams", len(self._queues))
        self._info = None
        self._stats = None
        self.fail_all("the scheduler process died")

    async def kv_state(self) -> KvState:
        """The scheduler's block map, at most MIN_INTERVAL_S old."""
        return await self._kv_states.get()

    async def _request_kv_state(self) -> None:
        await self._send(KvStateRequest())

    async def abort(self, request_id: str) -> None:
        await self._send(AbortRequest(request_id))

    async def _send(self, message) -> None:
        async with self._send_lock:
            await send(self._sock, message)

    async def _read(self) -> None:
        while True:
            self._deliver(await recv(self._sock))
            # Everything else already here too, before the streams run: a stream that fell
            # behind then finds several deltas queued and sends them as one (coalesce).
            for _ in range(DRAIN_MAX):  # bounded: the streams must get their turn
                if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                self._deliver(await recv(self._sock))

    def _deliver(self, message) -> None:
        self._last_seen = time.monotonic()
        if isinstance(message, TokenDeltas):
            self._stats = message.stats
            if self.stats_log is not None and (message.deltas or message.next_tokens):
                self.stats_log.append(message.stats)
            for delta in message.all_deltas():  # the plain one-token columns' too
                self._unacked.discard(delta.request_id)
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
        elif isinstance(message, KvState):
            self._kv_states.deliver(message)
        elif isinstance(message, SchedulerReady):
            if self._info is None:
                log.info("backend ready: %s", message.model_name)
            self._info = message


def coalesce(items: list[RequestDelta | BackendGone]) -> list[RequestDelta | BackendGone]:
    """Consecutive deltas of one request merged into one, so that a stream that fell behind
    (the gateway is busy) catches up with one detokenizer pass, one SSE chunk and one write
    instead of one per step. An error (of the request or of a sample) or a BackendGone is
    never merged: it ends the run before it and passes as it is."""
    if len(items) == 1:
        return items
    out: list[RequestDelta | BackendGone] = []
    run: list[RequestDelta] = []
    for item in items:
        if isinstance(item, RequestDelta) and _mergeable(item):
            run.append(item)
            if item.finished:  # nothing follows a request's last delta
                out.append(_merged(run))
                run = []
            continue
        if run:
            out.append(_merged(run))
            run = []
        out.append(item)
    if run:
        out.append(_merged(run))
    return out


def _mergeable(delta: RequestDelta) -> bool:
    """Not an error, nor a sample ended by abort or error: the gateway raises at those, so the
    tokens before them must arrive in a delta of their own."""
    return delta.error is None and not any(s.finish_reason in _FAILED for s in delta.seqs)


def _merged(run: list[RequestDelta]) -> RequestDelta:
    """One delta with every token of the run, per sample, in order (the inputs unchanged)."""
    if len(run) == 1:
        return run[0]
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    reasons: dict[int, str | None] = {}
    cumulative: dict[int, float | None] = {}
    for delta in run:
        for s in delta.seqs:
            tokens.setdefault(s.index, []).extend(s.token_ids)
            logprobs.setdefault(s.index, []).extend(s.logprobs)
            reasons[s.index] = s.finish_reason or reasons.get(s.index)
            if s.cumulative_logprob is not None or s.index not in cumulative:
                cumulative[s.index] = s.cumulative_logprob
    seqs = [SeqDelta(i, tokens[i], logprobs[i], reasons[i], cumulative[i]) for i in sorted(tokens)]
    first, last = run[0], run[-1]
    prompt = next((d.num_prompt_tokens for d in run if d.num_prompt_tokens), 0)
    scored = next((d.prompt_logprobs for d in run if d.prompt_logprobs is not None), None)
    return RequestDelta(
        first.request_id, seqs, last.finished, num_prompt_tokens=prompt, prompt_logprobs=scored
    )
