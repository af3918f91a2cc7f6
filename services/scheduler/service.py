"""The scheduler process: requests in from the gateways, a plan per step to the executor, deltas
out to the gateway that sent each request.

It keeps reading requests and aborts while a step runs (asyncio), so admission and cancellation
take effect at the next iteration boundary. The steps themselves are the engine core's
(`engine_core.py`) over the executor process (`remote_executor.py`); this module supervises:
intake, executor replacement, heartbeats and stats.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import zmq
import zmq.asyncio

from services.config_args import add_config_json_arg, add_engine_args, engine_config_from_args
from services.restart_budget import RestartBudget, add_restart_args
from services.scheduler.engine_core import EngineCore, StepOutcome
from services.scheduler.gateway_links import GatewayLinks
from services.scheduler.kv_accounting import KVAccountant, kv_breakdown
from services.scheduler.kv_state import kv_snapshot
from services.scheduler.outputs import group_delta, step_deltas
from services.scheduler.plan_log import PlanLog
from services.scheduler.remote_executor import HEARTBEAT_S, ExecutorLost, RemoteExecutor
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.errors import PagedServeError
from shared.heap import freeze_startup_heap
from shared.ipc import Addresses, add_address_args, addresses_from_args, make_socket
from shared.model_source import model_name
from shared.protocol import (
    AbortRequest,
    ExecutorReady,
    ForgetGrammars,
    GatewayHello,
    GenerateRequest,
    GrammarCompiled,
    KvStateRequest,
    RequestDelta,
    SchedulerReady,
    SchedulerStats,
    Shutdown,
    TokenDeltas,
)

log = logging.getLogger("pagedserve.scheduler")


class SchedulerService:
    def __init__(
        self,
        config: EngineConfig,
        addresses: Addresses,
        name: str,
        parent_pid: int | None = None,
        plan_log: str | None = None,
        restarts: RestartBudget | None = None,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.parent_pid = parent_pid
        self._plan_log = PlanLog(plan_log) if plan_log else None
        self.addresses = addresses
        self.model_name = name
        self.model_aliases = aliases
        self.scheduler: Scheduler | None = None
        self.core: EngineCore | None = None
        self._work = asyncio.Event()
        self._last_result_at = 0.0
        self._stopping = asyncio.Event()
        self._last_step = (0.0, 0.0, 0.0)  # scheduler, executor, round trip seconds
        self._crashed = False
        self._kv_accountant = KVAccountant()
        self._kv_fractions: dict[str, float] = {}
        self._restarts = restarts or RestartBudget(0, 1.0)
        self._new_ready: ExecutorReady | None = None  # a replacement's announcement
        self._executor_back = asyncio.Event()
        self.num_executor_restarts = 0
        self._announcement: SchedulerReady | None = None

    async def run(self) -> int:
        ctx = zmq.asyncio.Context()
        gateways = make_socket(ctx, zmq.ROUTER, self.addresses.gateway, bind=True)
        self.gateways = GatewayLinks(gateways, self._abort_orphans)
        self.executor = RemoteExecutor(ctx, self.addresses)
        # Watched from before anyone connects, so that every peer is counted.
        executor_watch = self.executor.watch(self._on_executor_lost)
        gateway_watch = self.gateways.watch(
            lambda: self._stats() if self.scheduler is not None else None
        )
        try:
            ready = await self.executor.wait_ready()
            self.scheduler = Scheduler(
                self.config.scheduler, ready, self.config.grammar, self.config.speculative
            )
            overlap = self.config.scheduler.async_scheduling
            self.core = EngineCore(self.scheduler, self.executor, overlap)
            self._announcement = SchedulerReady(
                ready,
                self.config.scheduler.max_num_seqs,
                self.model_name,
                self.config.grammar.limits,
                self.model_aliases,
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
                    self._executor_messages(),
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
            await self.executor.send(Shutdown("scheduler stopping"))
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
                await self.gateways.send(peer, kv_snapshot(self.scheduler, self.core.preemptions))
            elif isinstance(message, GatewayHello):
                # A gateway (re)connected: it needs the model's announcement before it serves.
                await self.gateways.send(peer, self._announcement)
                await self.gateways.send(peer, TokenDeltas([], self._stats()))
            elif isinstance(message, Shutdown):
                self._stopping.set()

    async def _executor_messages(self) -> None:
        """What the executor says beside step results: a replacement's announcement, compiled
        grammars."""
        while True:
            message = await self.executor.receive()
            if isinstance(message, ExecutorReady):
                log.info("a new executor announced itself: %s", message)
                self._new_ready = message
                self._executor_back.set()
            elif isinstance(message, GrammarCompiled):
                update = self.scheduler.grammar_compiled(
                    message.key, message.error, message.error_type
                )
                if update is not None:
                    await self.gateways.send_deltas([group_delta(update)], self._stats())
                self._work.set()  # it joined the waiting queue
            else:
                log.warning("unexpected message from the executor: %s", type(message).__name__)

    async def _steps(self) -> None:
        core = self.core
        while True:
            if not self.executor.up:
                # Plans in flight died with the executor; their groups are recomputed.
                self.executor.forget()
                core.forget()
                if not await self._replace_executor():
                    return
                continue
            await self._send_compiles()  # after a restart: asked of the new executor
            if not core.has_schedulable():  # grammar waits alone: nothing to plan
                self._work.clear()
                await self._work.wait()
                continue
            try:
                outcome = await core.step()  # raises (the task dies) when nothing moved
            except ExecutorLost:
                continue  # the top of the loop forgets its steps and waits for a new one
            try:
                await core.launch_next()  # the executor runs while these outputs go out
            except ExecutorLost:
                pass  # this step's outputs still go out; the top of the loop replaces it
            await self._finish_step(outcome)

    async def _finish_step(self, outcome: StepOutcome) -> None:
        now = outcome.collected_at
        # Overlapped steps run back to back: one step's share of the wall clock starts when the
        # previous result arrived, not when its plan was sent.
        wall = now - max(outcome.launched_at, self._last_result_at)
        self._last_result_at = now
        executor_s = sum(outcome.result.timings.values())
        self._last_step = (self.core.schedule_s, executor_s, now - outcome.launched_at)
        breakdown = kv_breakdown(self.scheduler)
        self._kv_fractions = breakdown.fractions()
        self._kv_accountant.add(breakdown, wall)
        if self._plan_log is not None:
            self._plan_log.write(self.scheduler, outcome.plan, outcome.updates)
        deltas, next_tokens = step_deltas(outcome.updates)
        await self.gateways.send_deltas(deltas, self._stats(), next_tokens)

    # ---- a dead executor or gateway ------------------------------------------------------------
    def _on_executor_lost(self) -> None:
        if self.scheduler is None or not self.executor.up:
            return
        log.error("the executor's connection closed; waiting for a new executor")
        self.executor.lose()
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
        self.executor.back()
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

    async def _send_compiles(self) -> None:
        """Ask the executor for the grammars new requests need, beside the plans."""
        if not self.executor.up:
            return  # requeue_all asks the next executor for all of them again
        for request in self.scheduler.take_compile_requests():
            if not await self.executor.send(request):
                # An executor that reads no plans is dying: its replacement is asked again,
                # and the request's own timer ends it otherwise.
                log.warning("could not ask the executor for grammar %d", request.key)

    async def _send_forgets(self) -> None:
        """Tell the executor at once which grammar waits ended unadmitted, so that it stops
        their compiles even while no step runs (plans carry freed sequences only when sent)."""
        if self.scheduler is None or not self.executor.up:
            return  # requeue_all forgets them: the next executor never hears of them
        seq_ids = self.scheduler.take_grammar_forgets()
        if seq_ids and not await self.executor.send(ForgetGrammars(seq_ids)):
            log.warning("could not tell the executor to forget %d grammars", len(seq_ids))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            # Not while the executor is down: its replacement is asked afresh, with new deadlines.
            expired = []
            if self.scheduler is not None and self.executor.up:
                expired = self.scheduler.expire_grammar_waits()
            if expired:
                await self.gateways.send_deltas([group_delta(u) for u in expired], self._stats())
            await self._send_forgets()  # the expired, and orphans aborted since the last beat
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process is gone; exiting")
                self._stopping.set()
            await self.gateways.broadcast(TokenDeltas([], self._stats()))

    # ---- helpers ------------------------------------------------------------------------------
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
            num_steps=self.core.num_steps,
            step_scheduler_s=scheduler_s,
            step_executor_s=executor_s,
            step_roundtrip_s=roundtrip_s,
            executor_alive=self.executor.up and self.executor.alive(),
            executor_restarting=not self.executor.up,
            num_executor_restarts=self.num_executor_restarts,
            kv_policy=self.config.scheduler.kv_policy,
            kv_fractions=self._kv_fractions,
            kv_fractions_avg=self._kv_accountant.averages(),
            prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            prefix_cache_blocks=s.block_manager.num_cached_blocks,
            spec_method=self.config.speculative.method or "",
            spec_proposed_tokens=s.speculation.num_proposed if s.speculation else 0,
            spec_accepted_tokens=s.speculation.num_accepted if s.speculation else 0,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler")
    add_engine_args(parser)
    add_config_json_arg(parser)
    add_address_args(parser)
    parser.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="the name the API reports; repeat for aliases requests may use as well",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this one exits")
    parser.add_argument("--plan-log", default=None, help="append one JSON line per step here")
    add_restart_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = engine_config_from_args(args)
    name, *aliases = args.model_name or [model_name(config.model.model)]
    restarts = RestartBudget(args.max_restarts, args.restart_window)
    service = SchedulerService(
        config,
        addresses_from_args(args),
        name,
        args.parent_pid,
        args.plan_log,
        restarts,
        tuple(aliases),
    )
    import uvloop

    log.info("scheduler pid %d", os.getpid())
    return uvloop.run(service.run())
