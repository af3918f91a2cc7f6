"""The scheduler process: requests in from the gateways, a plan per step to the executor, deltas
out to the gateway that sent each request.

It keeps reading requests and aborts while a step runs (asyncio), so admission and cancellation
take effect at the next iteration boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time

import zmq
import zmq.asyncio

from services.engine_flags import add_config_json_arg, add_engine_args, engine_config_from_args
from services.restart_budget import RestartBudget, add_restart_args
from services.scheduler.gateway_links import GatewayLinks
from services.scheduler.kv_accounting import KVAccountant, kv_breakdown
from services.scheduler.kv_state import PreemptionLog, kv_snapshot
from services.scheduler.scheduler import GroupUpdate, Scheduler
from services.scheduler.step_loop import StepLoop
from shared.config import EngineConfig
from shared.errors import PagedServeError
from shared.heap import freeze_startup_heap
from shared.ipc import Addresses, add_address_args, addresses_from_args, make_socket, recv, send
from shared.model_source import model_name
from shared.peer_watch import PeerWatch
from shared.protocol import (
    AbortRequest,
    ExecutorHeartbeat,
    ExecutorReady,
    ForgetGrammars,
    GatewayHello,
    GenerateRequest,
    GrammarCompiled,
    KvStateRequest,
    RequestDelta,
    SchedulerReady,
    SchedulerStats,
    SeqDelta,
    Shutdown,
    StepResult,
    TokenDeltas,
)

log = logging.getLogger("pagedserve.scheduler")
HEARTBEAT_S = 1.0
EXECUTOR_TIMEOUT_S = 10.0  # no executor heartbeat for this long: it is gone


class ExecutorLost(Exception):
    """The executor's connection closed: its process died (a new one is on its way)."""


def group_delta(update: GroupUpdate) -> RequestDelta:
    """The request's new tokens per sample, with each ended sample's finish reason."""
    group = update.group
    want_logprobs = group.sampling.logprobs is not None
    by_index: dict[int, SeqDelta] = {}
    if group.sampling.reports_at_end:
        # best_of, beam search: the chosen sequences are known only at the end; they go out
        # whole then.
        for index, seq in group.reported_seqs():
            logprobs = list(seq.logprobs) if want_logprobs else []
            by_index[index] = SeqDelta(
                index,
                seq.output_token_ids,
                logprobs,
                seq.finish_reason,
                seq.cumulative_logprob if group.beam is not None else None,
            )
    else:
        for seq, token in update.new_tokens:
            delta = by_index.setdefault(seq.index, SeqDelta(seq.index, []))
            delta.token_ids.append(token.token_id)
            if want_logprobs:
                delta.logprobs.append(token)
        for seq in group.seqs:
            if seq.is_finished:
                by_index.setdefault(
                    seq.index, SeqDelta(seq.index, [])
                ).finish_reason = seq.finish_reason
    return RequestDelta(
        group.request_id,
        [by_index[i] for i in sorted(by_index)],
        update.finished,
        update.error,
        num_prompt_tokens=len(group.prompt_token_ids),
    )


class SchedulerService:
    def __init__(
        self,
        config: EngineConfig,
        addresses: Addresses,
        name: str,
        parent_pid: int | None = None,
        plan_log: str | None = None,
        restarts: RestartBudget | None = None,
    ) -> None:
        self.config = config
        self.parent_pid = parent_pid
        # One JSON line per step: which requests ran, which finished (shows iteration batching).
        self._plan_log = open(plan_log, "a", buffering=1) if plan_log else None
        self.addresses = addresses
        self.model_name = name
        self.scheduler: Scheduler | None = None
        self._work = asyncio.Event()
        # step_id -> (its result, perf_counter() when the plan was sent), for plans in flight
        self._in_flight: dict[int, tuple[asyncio.Future[StepResult], float]] = {}
        self._last_result_at = 0.0
        self._executor_seen = time.monotonic()
        self._stopping = asyncio.Event()
        self._last_step = (0.0, 0.0, 0.0)  # scheduler, executor, round trip seconds
        self._crashed = False
        self._num_steps = 0
        self._kv_accountant = KVAccountant()
        self._kv_fractions: dict[str, float] = {}
        self._preemptions = PreemptionLog()  # for the block map (KvStateRequest)
        self._restarts = restarts or RestartBudget(0, 1.0)
        self._executor_up = True  # False from its loss until a new one has announced itself
        self._new_ready: ExecutorReady | None = None  # a replacement's announcement
        self._executor_back = asyncio.Event()
        self.num_executor_restarts = 0
        self._announcement: SchedulerReady | None = None

    async def run(self) -> int:
        ctx = zmq.asyncio.Context()
        gateways = make_socket(ctx, zmq.ROUTER, self.addresses.gateway, bind=True)
        self.gateways = GatewayLinks(gateways, self._abort_orphans)
        self.plans = make_socket(ctx, zmq.PUSH, self.addresses.plans, bind=True)
        self.results = make_socket(ctx, zmq.PULL, self.addresses.results, bind=True)
        # Watched from before anyone connects, so that every peer is counted.
        executor_watch = PeerWatch(self.plans, self._on_executor_lost)
        gateway_watch = self.gateways.watch(
            lambda: self._stats() if self.scheduler is not None else None
        )
        try:
            ready = await self._wait_for_executor()
            self.scheduler = Scheduler(self.config.scheduler, ready, self.config.grammar)
            self._announcement = SchedulerReady(
                ready,
                self.config.scheduler.max_num_seqs,
                self.model_name,
                self.config.grammar.limits,
            )
            freeze_startup_heap()
            log.info(
                "scheduler ready: %d device blocks, %d cpu blocks",
                ready.num_device_blocks,
                ready.num_cpu_blocks,
            )
            tasks = [
                asyncio.create_task(coro)
                for coro in (
                    self._intake(),
                    self._steps(),
                    self._heartbeat(),
                    self._results(),
                    executor_watch.run(),
                    gateway_watch.run(),
                )
            ]
            for task in tasks:
                task.add_done_callback(self._on_task_done)
            await self._stopping.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._send_executor_shutdown()
            return 1 if self._crashed else 0
        finally:
            ctx.destroy(linger=0)

    def _on_task_done(self, task: asyncio.Task) -> None:
        # A dead task would leave requests waiting forever behind a healthy heartbeat: stop the
        # process instead, so the launcher reports it and the gateway ends open streams.
        if task.cancelled() or self._stopping.is_set():
            return
        exc = task.exception()
        log.error(
            "scheduler task %s ended: %r; stopping", task.get_coro().__name__, exc, exc_info=exc
        )
        self._crashed = True
        self._stopping.set()

    async def _wait_for_executor(self) -> ExecutorReady:
        while True:
            message = await recv(self.results)
            if isinstance(message, ExecutorReady):
                self._executor_seen = time.monotonic()
                return message

    # ---- tasks --------------------------------------------------------------------------------
    async def _intake(self) -> None:
        while True:
            try:
                peer, message = await self.gateways.recv()
            except ValueError as exc:  # a malformed message (WireError, bad values): drop it
                log.warning("dropped a malformed request message: %s", exc)
                continue
            if isinstance(message, GenerateRequest):
                try:
                    self.scheduler.add_request(
                        message.request_id, message.prompt_token_ids, message.sampling
                    )
                    # Acknowledge at once: the gateway counts a request as queued here from
                    # now on (stats.num_waiting), no longer as in transit.
                    reply = RequestDelta(
                        message.request_id, [], False,
                        num_prompt_tokens=len(message.prompt_token_ids),
                    )  # fmt: skip
                    self.gateways.own(peer, message.request_id)
                    await self.gateways.send_deltas([reply], self._stats())
                    await self._send_compiles()
                    self._work.set()
                except PagedServeError as exc:  # invalid (400), or too many grammars (429)
                    reply = RequestDelta(message.request_id, [], True, exc.to_dict()["error"])
                    await self.gateways.send(peer, TokenDeltas([reply], self._stats()))
            elif isinstance(message, AbortRequest):
                update = self.scheduler.abort(message.request_id)
                if update is not None:
                    await self.gateways.send_deltas([group_delta(update)], self._stats())
                await self._send_forgets()
            elif isinstance(message, KvStateRequest):
                await self.gateways.send(peer, kv_snapshot(self.scheduler, self._preemptions))
            elif isinstance(message, GatewayHello):
                # A gateway (re)connected: it needs the model's announcement before it serves.
                await self.gateways.send(peer, self._announcement)
                await self.gateways.send(peer, TokenDeltas([], self._stats()))
            elif isinstance(message, Shutdown):
                self._stopping.set()

    async def _results(self) -> None:
        """Demultiplex the executor's pipe: heartbeats refresh liveness, results end a step."""
        while True:
            message = await recv(self.results)
            self._executor_seen = time.monotonic()
            if isinstance(message, ExecutorReady) and self.scheduler is not None:
                log.info("a new executor announced itself: %s", message)
                self._new_ready = message
                self._executor_back.set()
            elif isinstance(message, GrammarCompiled) and self.scheduler is not None:
                update = self.scheduler.grammar_compiled(
                    message.key, message.error, message.error_type
                )
                if update is not None:
                    await self.gateways.send_deltas([group_delta(update)], self._stats())
                self._work.set()  # it joined the waiting queue
            elif isinstance(message, StepResult):
                # A result that arrives after its step was given up on must not end another.
                future, _ = self._in_flight.get(message.step_id, (None, 0.0))
                if future is not None and not future.done():
                    future.set_result(message)
                elif future is None:
                    log.warning("dropped a late result for step %d", message.step_id)
            elif not isinstance(message, ExecutorHeartbeat | ExecutorReady | GrammarCompiled):
                log.warning("unexpected message from the executor: %s", type(message).__name__)

    async def _steps(self) -> None:
        scheduler = self.scheduler
        loop = StepLoop(scheduler)
        overlap = self.config.scheduler.async_scheduling
        while True:
            if not self._executor_up:
                if not await self._replace_executor():
                    return
                continue
            await self._send_compiles()  # after a restart: asked of the new executor
            if not scheduler.has_schedulable():  # grammar waits alone: nothing to plan
                self._work.clear()
                await self._work.wait()
                continue
            running_before, num_preemptions = list(scheduler.running), scheduler.num_preemptions
            plan = loop.plan()
            self._preemptions.note(running_before, num_preemptions, scheduler)
            try:
                await self._submit(plan)
                # Async scheduling: while `plan` runs, plan the next step if it needs nothing
                # of this one's result but the sampled tokens; repeat while that holds.
                while plan is not None:
                    ahead = loop.plan_ahead() if overlap else None
                    if ahead is not None:
                        await self._submit(ahead)
                    result, sent = await self._await_result(plan)
                    await self._finish_step(loop, plan, result, sent)
                    plan = ahead
            except ExecutorLost:
                # Plans in flight die with the executor; their groups are recomputed.
                for future, _ in self._in_flight.values():
                    if future.done() and not future.cancelled():
                        future.exception()  # retrieved: not an unhandled error
                self._in_flight.clear()
                loop.forget()

    async def _finish_step(self, loop: StepLoop, plan, result: StepResult, sent: float) -> None:
        now = time.perf_counter()
        # Overlapped steps run back to back: one step's share of the wall clock starts when the
        # previous result arrived, not when its plan was sent.
        wall = now - max(sent, self._last_result_at)
        self._last_result_at = now
        updates = loop.finish(plan, result)  # raises (the task dies) when nothing moved
        self._num_steps = loop.num_steps
        self._last_step = (loop.schedule_s, sum(result.timings.values()), now - sent)
        breakdown = kv_breakdown(self.scheduler)
        self._kv_fractions = breakdown.fractions()
        self._kv_accountant.add(breakdown, wall)
        if self._plan_log is not None:
            self._log_step(plan, updates)
        await self.gateways.send_deltas([group_delta(u) for u in updates], self._stats())

    # ---- a dead executor or gateway ------------------------------------------------------------
    def _on_executor_lost(self) -> None:
        if self.scheduler is None or not self._executor_up:
            return
        log.error("the executor's connection closed; waiting for a new executor")
        self._executor_up = False
        for future, _ in self._in_flight.values():
            if not future.done():
                future.set_exception(ExecutorLost())
        self._work.set()  # an idle step loop wakes up to wait for the replacement

    async def _replace_executor(self) -> bool:
        """Wait for a new executor and requeue every request on it; False when the restart
        budget is spent (every request then ends with an error and the process stops)."""
        if not self._restarts.allow():
            await self._give_up()
            return False
        while self._new_ready is None:
            self._executor_back.clear()
            await self._executor_back.wait()
        ready, self._new_ready = self._new_ready, None
        self.scheduler.requeue_all(ready)
        self.num_executor_restarts += 1
        self._executor_seen = time.monotonic()
        self._executor_up = True
        log.info("requeued %d requests on the new executor", len(self.scheduler.groups))
        return True

    async def _give_up(self) -> None:
        message = (
            f"the executor died again with its restart budget ({self._restarts.describe()}) "
            "spent; the server gives up"
        )
        log.error(message)
        error = {
            "message": message,
            "type": "service_unavailable_error",
            "param": None,
            "code": "executor_failed",
        }
        deltas = []
        for request_id in list(self.scheduler.groups):
            self.scheduler.abort(request_id)
            deltas.append(RequestDelta(request_id, [], True, error))
        await self.gateways.send_deltas(deltas, self._stats())
        self._crashed = True
        self._stopping.set()

    def _abort_orphans(self, request_ids: list[str]) -> None:
        # Their gateway left: nobody reads their tokens any more, so stop decoding them and
        # free their blocks.
        if self.scheduler is None:
            return
        for request_id in request_ids:
            self.scheduler.abort(request_id)
        log.warning("a gateway's connection closed; aborted %d requests", len(request_ids))

    async def _submit(self, plan) -> None:
        """Send a plan; its result arrives through _results into its future. A send to a dead
        executor would wait forever, so it is bounded; a silent executor fails the step.
        Raises ExecutorLost when the executor's connection closes meanwhile."""
        future = asyncio.get_running_loop().create_future()
        self._in_flight[plan.step_id] = (future, time.perf_counter())
        while True:
            if not self._executor_up:
                raise ExecutorLost()
            try:
                await asyncio.wait_for(send(self.plans, plan), HEARTBEAT_S)
                return
            except TimeoutError:
                if not self._executor_alive():
                    future.set_result(_no_response(plan.step_id))
                    return

    async def _await_result(self, plan) -> tuple[StepResult, float]:
        """(the plan's result, when it was sent); raises ExecutorLost like _submit."""
        future, sent = self._in_flight[plan.step_id]
        try:
            while True:
                if not self._executor_up:
                    raise ExecutorLost()
                try:
                    return await asyncio.wait_for(asyncio.shield(future), HEARTBEAT_S), sent
                except TimeoutError:
                    if not self._executor_alive():
                        return _no_response(plan.step_id), sent
        finally:
            del self._in_flight[plan.step_id]
            if future.done() and not future.cancelled():
                future.exception()  # retrieved (an ExecutorLost we raised ourselves)

    async def _send_compiles(self) -> None:
        """Ask the executor for the grammars new requests need, beside the plans."""
        if not self._executor_up:
            return  # requeue_all asks the next executor for all of them again
        for request in self.scheduler.take_compile_requests():
            try:
                await asyncio.wait_for(send(self.plans, request), HEARTBEAT_S)
            except TimeoutError:
                # An executor that reads no plans is dying: its replacement is asked again,
                # and the request's own timer ends it otherwise.
                log.warning("could not ask the executor for grammar %d", request.key)

    async def _send_forgets(self) -> None:
        """Tell the executor at once which grammar waits ended unadmitted, so that it stops
        their compiles even while no step runs (plans carry freed sequences only when sent)."""
        if self.scheduler is None or not self._executor_up:
            return  # requeue_all forgets them: the next executor never hears of them
        seq_ids = self.scheduler.take_grammar_forgets()
        if not seq_ids:
            return
        try:
            await asyncio.wait_for(send(self.plans, ForgetGrammars(seq_ids)), HEARTBEAT_S)
        except TimeoutError:
            log.warning("could not tell the executor to forget %d grammars", len(seq_ids))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            # Not while the executor is down: its replacement is asked afresh, with new deadlines.
            expired = []
            if self.scheduler is not None and self._executor_up:
                expired = self.scheduler.expire_grammar_waits()
            if expired:
                await self.gateways.send_deltas([group_delta(u) for u in expired], self._stats())
            await self._send_forgets()  # the expired, and orphans aborted since the last beat
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process is gone; exiting")
                self._stopping.set()
            await self.gateways.broadcast(TokenDeltas([], self._stats()))

    # ---- helpers ------------------------------------------------------------------------------
    async def _send_executor_shutdown(self) -> None:
        try:
            await asyncio.wait_for(send(self.plans, Shutdown("scheduler stopping")), 1.0)
        except TimeoutError:
            pass

    def _log_step(self, plan, updates: list[GroupUpdate]) -> None:
        group_of = {s.seq_id: g.request_id for g in self.scheduler.groups.values() for s in g.seqs}
        for update in updates:
            group_of.update({s.seq_id: update.group.request_id for s in update.group.seqs})
        line = {
            "step": plan.step_id,
            "requests": sorted({group_of.get(s.seq_id, "?") for s in plan.seqs}),
            "num_tokens": plan.num_tokens,
            "finished": sorted(u.group.request_id for u in updates if u.finished),
        }
        self._plan_log.write(json.dumps(line) + "\n")

    def _executor_alive(self) -> bool:
        return time.monotonic() - self._executor_seen < EXECUTOR_TIMEOUT_S

    def _stats(self) -> SchedulerStats:
        s = self.scheduler
        scheduler_s, executor_s, roundtrip_s = self._last_step
        return SchedulerStats(
            num_running=s.num_running_seqs,
            num_waiting=len(s.waiting) + len(s.grammar_waits),
            num_swapped=len(s.swapped),
            kv_blocks_used=s.block_manager.device.num_used,
            kv_blocks_total=s.block_manager.device.num_blocks,
            num_preemptions=s.num_preemptions,
            num_steps=self._num_steps,
            step_scheduler_s=scheduler_s,
            step_executor_s=executor_s,
            step_roundtrip_s=roundtrip_s,
            executor_alive=self._executor_up and self._executor_alive(),
            executor_restarting=not self._executor_up,
            num_executor_restarts=self.num_executor_restarts,
            kv_policy=self.config.scheduler.kv_policy,
            kv_fractions=self._kv_fractions,
            kv_fractions_avg=self._kv_accountant.averages(),
            prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            prefix_cache_blocks=s.block_manager.num_cached_blocks,
        )


def _no_response(step_id: int) -> StepResult:
    """A step failed for want of an answer: its requests end with an error instead of hanging."""
    log.error("executor stopped responding; failing step %d", step_id)
    return StepResult(step_id, [], error="the executor stopped responding")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler")
    add_engine_args(parser)
    add_config_json_arg(parser)
    add_address_args(parser)
    parser.add_argument("--model-name", default=None, help="the name the API reports")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this one exits")
    parser.add_argument("--plan-log", default=None, help="append one JSON line per step here")
    add_restart_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = engine_config_from_args(args)
    name = args.model_name or model_name(config.model.model)
    restarts = RestartBudget(args.max_restarts, args.restart_window)
    service = SchedulerService(
        config, addresses_from_args(args), name, args.parent_pid, args.plan_log, restarts
    )
    import uvloop

    log.info("scheduler pid %d", os.getpid())
    return uvloop.run(service.run())
