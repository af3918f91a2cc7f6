"""The scheduler: iteration-level batching under a token budget, admission and group preemption.

Who goes first and who yields is the scheduling policy's (policy.py, FCFS by default); every
queue here is kept in its order. One scheduling model for every sequence: the tokens whose K/V
are cached (num_computed_tokens) against all its tokens. A step gives each running sequence its
uncomputed tokens (1 when decoding, a chunk of the prompt when prefilling), so prefills and
decodes share one batch.

Why this module is longer than ~400 lines: admission, preemption, swapping and applying a
step's result all change the same three queues, block tables and sequence counters, and must
leave them consistent with each other after every call. What needs none of that state lives
apart: the order (policy.py), the budget's shares (token_budget.py), plan assembly
(step_plans.py), stop rules (stop_rules.py), beam bookkeeping (beam_search.py), restart
recovery (recovery.py) and request validation (shared/request_limits.py).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.beam_search import BeamSearch, advance_beams
from services.scheduler.block_manager import BlockManager
from services.scheduler.grammar_wait import ANSWER_GRACE_S, GrammarWaits
from services.scheduler.kv_policy import make_block_manager
from services.scheduler.layer_parts import plan_layer_part
from services.scheduler.lookahead import lookahead_seqs
from services.scheduler.policies import make_policy
from services.scheduler.prefix_reuse import PrefixReuse
from services.scheduler.recovery import start_over
from services.scheduler.sequence import SeqStatus, Sequence, SequenceGroup
from services.scheduler.speculation import Speculation
from services.scheduler.step_plans import PlanEntry, StepPlans
from services.scheduler.stop_rules import check_stop, max_output_tokens
from services.scheduler.token_budget import (
    budget_order,
    capped_decode_rows,
    share,
    step_prefill_cap,
)
from shared.config import GrammarConfig, SchedulerConfig, SpeculativeConfig
from shared.errors import (
    InvalidRequestError,
    PagedServeError,
    RateLimitError,
    ServiceUnavailableError,
)
from shared.protocol import (
    CompileGrammar,
    ExecutorReady,
    SampledToken,
    StepPlan,
    StepResult,
)
from shared.request_limits import RequestLimits
from shared.sampling import SamplingParams
from shared.structured import check_limits


@dataclass
class GroupUpdate:
    """What one step (or an abort) changed for one request."""

    group: SequenceGroup
    new_tokens: list[tuple[Sequence, SampledToken]] = field(default_factory=list)
    finished: bool = False
    error: dict | None = None  # the OpenAI error object of a request ended by an error


# What a grammar compile's answer may end its request with, by its error_type.
_GRAMMAR_ERRORS: dict[str, type[PagedServeError]] = {
    cls.error_type: cls for cls in (InvalidRequestError, RateLimitError, ServiceUnavailableError)
}


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        ready: ExecutorReady,
        grammar: GrammarConfig | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.grammar = grammar or GrammarConfig()
        # Structured-output requests wait here, outside every queue, until their grammar is
        # compiled (off the executor's step loop), so no step ever waits for a compile.
        self.grammar_waits = GrammarWaits(self.grammar.compile_timeout_s)
        self.block_size = ready.block_size
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = frozenset(ready.eos_token_ids)
        # Without chunked prefill a whole prompt must fit in one step, so the budget grows to the
        # longest prompt we accept.
        self.max_num_batched_tokens = config.token_budget(ready.device_type)
        self.token_budget = self.max_num_batched_tokens
        # Prompt tokens per request and step while others decode (chunks only split when chunked).
        cap = config.prefill_cap(ready.device_type) if config.enable_chunked_prefill else None
        self.prefill_cap = cap if cap is not None and cap < self.token_budget else None
        # Decode rows per request and step while other requests run (n > 1 takes turns).
        self.decode_row_cap = config.decode_row_cap(ready.device_type)
        self.context_cost_tokens = ready.context_cost_tokens
        # Deep chunks in layer parts where the executor computes them (layer_parts.py).
        self.context_read_rows = ready.context_read_rows if config.layer_parts else 0.0
        self.num_layers = ready.num_layers
        if not config.enable_chunked_prefill:
            self.token_budget = max(self.token_budget, ready.max_model_len)
        self.limits = RequestLimits.of(ready, config.max_num_seqs)
        self.max_seq_len = self.limits.max_seq_len
        self.rope_switch_len = ready.rope_switch_len
        self.block_manager: BlockManager = self._make_block_manager(ready)
        self.watermark_blocks = int(config.watermark * ready.num_device_blocks)
        self.policy = make_policy(config.scheduling_policy)

        # All three in the policy's order; recompute-preempted groups rejoin `waiting` in it.
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.groups: dict[str, SequenceGroup] = {}
        self.plans = StepPlans()
        # Sequences whose grammar wait ended unadmitted: told to the executor at once, not with
        # the next plan (there may be none for long), so that it stops their compiles.
        self._grammar_forgets: list[int] = []
        self._pending_updates: list[GroupUpdate] = []  # requests ended by schedule() itself
        self._next_seq_id = 0
        self._next_arrival = 0
        self.num_preemptions = 0
        self.num_rope_recomputes = 0  # sequences recomputed as they outgrew longrope's switch
        self.prefix_reuse = PrefixReuse(self.block_size)
        # Speculative decoding (speculation.py); None when off.
        self.speculation = (
            Speculation(speculative, self.max_seq_len)
            if speculative is not None and speculative.enabled
            else None
        )
        self._proposals: dict[int, list[int]] = {}  # seq_id -> this plan's proposed tokens

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> SequenceGroup:
        """Validate and queue a request; raises InvalidRequestError without side effects, or
        RateLimitError for a grammar request while --max-pending-grammars wait for theirs."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="id")
        self.limits.check_prompt(prompt_token_ids)
        self.block_manager.validate_request(sampling)
        self.policy.check_request(sampling)
        self.limits.check_num_samples(sampling)
        if sampling.guided is not None:
            # Only the limits: parsing the spec here would hold the step loop (2.5 s for
            # 10,000 choices); the gateway checked it off its loop, and the executor's compile
            # answers a 400 for a spec that does not compile.
            check_limits(*sampling.guided, self.grammar.limits)
            pending = self.grammar_waits.pending_specs()
            if sampling.guided not in pending and len(pending) >= self.grammar.max_pending:
                raise RateLimitError(
                    f"{len(pending)} different grammars already wait to be compiled (this "
                    f"server's --max-pending-grammars); retry later",
                    param="guided",
                )
        self.limits.check_token_ids(sampling)
        seq = Sequence(self._new_seq_id(), 0, list(prompt_token_ids), len(prompt_token_ids))
        group = SequenceGroup(request_id, self._next_arrival, sampling, [seq])
        if sampling.use_beam_search:
            group.beam = BeamSearch(
                sampling,
                sampling.ending_token_ids(tuple(self.eos_token_ids)),
                max_output_tokens(sampling, len(prompt_token_ids), self.max_seq_len),
            )
        self._next_arrival += 1
        self.groups[request_id] = group
        if sampling.guided is not None:
            self.grammar_waits.hold(group)
        else:
            self.policy.enqueue(self.waiting, group)
        return group

    # ---- grammars -----------------------------------------------------------------------------
    def take_compile_requests(self) -> list[CompileGrammar]:
        """CompileGrammar messages for the executor, each sent once."""
        return self.grammar_waits.take_requests()

    def take_grammar_forgets(self) -> list[int]:
        """Sequences whose grammar the executor should forget now (ForgetGrammars)."""
        seq_ids, self._grammar_forgets = self._grammar_forgets, []
        return seq_ids

    def grammar_compiled(
        self, key: int, error: str | None, error_type: str = InvalidRequestError.error_type
    ) -> GroupUpdate | None:
        """The executor's answer: the request joins the waiting queue in policy order, or ends
        alone with an invalid_request_error (its spec's fault), a rate_limit_error (it waited
        behind other compiles past the limit) or a service_unavailable_error (the compiler's).
        None for an answer nobody waits for any more."""
        group = self.grammar_waits.answered(key)
        if group is None:
            return None
        if error is not None:
            failed = _GRAMMAR_ERRORS.get(error_type, InvalidRequestError)
            return self._end_with_error(group, failed(error, param="guided"))
        self.policy.enqueue(self.waiting, group)
        return None

    def expire_grammar_waits(self) -> list[GroupUpdate]:
        """End the requests whose compile was not answered in time: the executor kills a
        compile past its own limit and answers, so this is the server's fault (compiles queued
        ahead, an executor that never answers), a 503, not the spec's."""
        updates = []
        for group in self.grammar_waits.expired():
            self._grammar_forgets.extend(s.seq_id for s in group.live_seqs())
            error = ServiceUnavailableError(
                f"the grammar compiler is busy: the {group.sampling.guided[0]} constraint "
                f"waited {self.grammar_waits.timeout_s + ANSWER_GRACE_S:g} s for its compile; "
                "retry later",
                param="guided",
                code="grammar_compiler_busy",
            )
            updates.append(self._end_with_error(group, error))
        return updates

    def _end_with_error(self, group: SequenceGroup, error: PagedServeError) -> GroupUpdate:
        for seq in group.live_seqs():
            self._finish(group, seq, "error")
        return GroupUpdate(group, finished=True, error=error.to_dict()["error"])

    def has_schedulable(self) -> bool:
        """Something a step could work on: requests waiting only for their grammar are not."""
        return bool(self.running or self.waiting or self.swapped or self._pending_updates)

    def abort(self, request_id: str) -> GroupUpdate | None:
        """End a request now and free its blocks. Safe while a step holding it is in flight: the
        blocks are only reused by a later plan, and update() skips finished sequences."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for queue in (self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.waiting:
            self.waiting.remove(group)
        self.grammar_waits.drop(request_id)
        if group.sampling.guided is not None:
            # Compiling, or compiled and held for it: the executor forgets it now (a no-op for
            # sequences already running, which the next plan frees).
            self._grammar_forgets.extend(s.seq_id for s in group.live_seqs())
        for seq in group.live_seqs():
            self._finish(group, seq, "abort")
        return GroupUpdate(group, finished=True)

    def requeue_all(self, ready: ExecutorReady) -> None:
        """A new executor with empty pools replaced a dead one: every unfinished group starts
        over (recovery.py) in policy order; the plan in flight is forgotten (its tokens were
        never reported)."""
        groups = self.policy.ordered([*self.running, *self.swapped, *self.waiting])
        compiling = self.grammar_waits.clear()
        self.block_manager = self._make_block_manager(ready)
        start_over(groups)
        # The new executor has no grammars: every structured-output request waits for its
        # compile again (all its live sequences will need a matcher there).
        for group in self.policy.ordered(compiling + groups):
            if group.sampling.guided is not None:
                self.grammar_waits.hold(group)
        groups = [g for g in groups if g.sampling.guided is None]
        self.running, self.swapped, self.waiting = [], [], deque(groups)
        self.plans.forget()
        self._grammar_forgets = []

    def _make_block_manager(self, ready: ExecutorReady) -> BlockManager:
        return make_block_manager(
            self.config.kv_policy,
            ready.block_size,
            ready.num_device_blocks,
            ready.num_cpu_blocks,
            self.max_seq_len,
            # Under longrope a block's K/V depends on its sequence's length, not its tokens alone.
            self.config.enable_prefix_caching and ready.rope_switch_len is None,
            ready.sliding_window,
            self.token_budget,
        )

    @property
    def prefix_cache_queried_tokens(self) -> int:
        return self.prefix_reuse.queried_tokens

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.prefix_reuse.hit_tokens

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_seats for g in self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        if self.plans.inflight:
            # Its counters would count the step in flight as not computed and plan it again.
            raise RuntimeError("schedule() while a step is in flight: await its result first")
        budget = self.token_budget
        cap, decoding = step_prefill_cap(self.running, self.prefill_cap, self.decode_row_cap)
        entries: list[PlanEntry] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        victims: list[SequenceGroup] = []  # swapped out by this plan
        preempted = False

        scheduled: set[SequenceGroup] = set()  # given tokens by this plan
        # Proposed tokens this step may add: never the tokens the running sequences' own
        # decodes need.
        spec_room = 0
        if self.speculation is not None and self.speculation.active(self.num_running_seqs):
            spec_room = budget - self.num_running_seqs
            queued = bool(self.waiting or self.swapped)
            self.speculation.start_step(self.num_running_seqs, self.running, queued)
        for group in budget_order(self.running, self.config.budget_order):
            live = group.live_seqs()
            if not live or live[0].status is not SeqStatus.RUNNING:
                continue  # preempted (or ended) earlier in this step
            writes = _plain_decode(live, budget)  # most groups: what the calls below find
            if (
                writes is not None
                and spec_room <= 0
                and self.rope_switch_len is None
                and self.block_manager.writes_in_place(live[0].seq_id, live[0].num_computed_tokens)
            ):
                # Its slot needs no block: nothing to check, preempt or allocate (what
                # _can_write, the loop below and _write come to for it, without their calls).
                entries.append(PlanEntry(live[0], group, 1, []))
                budget -= 1
                scheduled.add(group)
                continue
            if writes is None:
                writes = self._part_writes(group, live, budget, cap, decoding)
            if writes is None:
                writes = capped_decode_rows(group, live, self.decode_row_cap, len(self.running) > 1)
            if writes is None:
                writes = self._plan_writes(group, self._share(group, budget, cap, decoding))
            if not writes:
                continue
            if self._outgrows_rope_writes(writes):
                self.running.remove(group)
                self._recompute_for_rope(group)
                continue
            while not self._can_write(writes):
                victim = self.policy.victim(self.running)
                if victim is group and len(self.running) == 1:
                    self.running.pop()  # alone and still too big for the whole pool
                    self._end_for_capacity(group)
                    break
                if victim in scheduled:
                    # Only under decode-first (in policy order the victim, the last group, is
                    # never served before the group asking): a prompt chunk does not take
                    # the blocks of a stream already given its token; it waits a step.
                    break
                if self._preempt(victim, swap_out):
                    victims.append(victim)
                preempted = True
                if victim is group:
                    break
            else:
                if spec_room > 0 and not self._may_outgrow_rope(group, spec_room):
                    writes, used = self._with_proposals(group, writes, spec_room)
                    spec_room -= used
                budget -= self._write(group, writes, entries)
                scheduled.add(group)

        # Preempted groups come back in policy order whichever way they left (swapped, or
        # recomputed into `waiting`): one merge of the two queues by the policy's key.
        may_start = not preempted or self.policy.admits_after_preemption()
        while may_start and (self.swapped or self.waiting):
            swapped_first = self.policy.swapped_first(self.swapped, self.waiting)
            resume = self._swap_in if swapped_first else self._admit
            head = self.swapped[0] if swapped_first else self.waiting[0]
            used = resume(self._share(head, budget, cap, decoding), entries, swap_in)
            if used is None:
                break
            budget -= used

        plan = self.plans.plan(self.block_manager, entries, swap_out, swap_in, victims)
        if self.speculation is not None:
            self.speculation.planned(plan.step_id, entries if spec_room > 0 else None)
        return plan

    def schedule_ahead(self) -> StepPlan | None:
        """Plan the next step while the one in flight runs (async scheduling), or None when the
        next step needs this one's result (see lookahead.py): then wait for it and schedule().

        Only with exactly one step in flight, no queued request that schedule() could admit or
        swap in now, and a free block for every sequence that crosses into a new one: it never
        admits, resumes or preempts. (A queued request that cannot start now, for want of a
        seat, blocks or budget, does not stop it: schedule() would not start it either, and the
        first step after room appears is a synchronous one.)
        """
        if len(self.plans.inflight) != 1 or self._pending_updates:
            return None
        if self.speculation is not None and self.speculation.active(self.num_running_seqs):
            return None  # the next step may speculate: its proposals need this step's token
        if (self.waiting or self.swapped) and self._could_start_queued():
            return None
        (entries,) = self.plans.inflight.values()
        ahead = lookahead_seqs(entries, self.running, self.max_seq_len)
        if ahead is None:
            return None
        # The step in flight computes position num_computed_tokens; the next one the next.
        if self.rope_switch_len is not None and any(
            self._outgrows_rope(e.seq, e.seq.num_computed_tokens + 2) for e in ahead
        ):
            return None  # that sequence is recomputed first (schedule())
        plan = self.plans.plan_ahead(self.block_manager, ahead)
        if self.speculation is not None:
            self.speculation.planned(plan.step_id, None)
        return plan

    def _could_start_queued(self) -> bool:
        """Whether schedule() might admit or swap in the head of the queues now. Errs towards
        True (a synchronous step is only slower; a wrong False would delay the request)."""
        swapped_first = self.policy.swapped_first(self.swapped, self.waiting)
        group = self.swapped[0] if swapped_first else self.waiting[0]
        decoding = sum(len(g.live_seqs()) for g in self.running)
        if not self._has_seats(group) or self.token_budget - decoding <= 0:
            return False
        if swapped_first:
            seq_ids = [s.seq_id for s in group.live_seqs()]
            return self._fits(self.block_manager.num_blocks_of(seq_ids, cpu=True))
        reused = self.prefix_reuse.lookup(self.block_manager, group)
        need = self.block_manager.admission_blocks(group, reused)
        return self._fits(need) and self.block_manager.can_admit(group, need)

    def _with_proposals(
        self, group: SequenceGroup, writes: list[tuple[Sequence, int]], room: int
    ) -> tuple[list[tuple[Sequence, int]], int]:
        """The writes with each decoding sequence's proposals added (kept for _write), and the
        proposed tokens they add; the plain writes when the proposals' slots would need a
        block the watermark keeps: speculation never preempts nor eats the reserve."""
        spec_writes, added = [], 0
        for seq, n in writes:
            proposals: list[int] = []
            if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:
                proposals = self.speculation.propose(group, seq, room - added)
            if proposals:
                self._proposals[seq.seq_id] = proposals
                added += len(proposals)
            spec_writes.append((seq, n + len(proposals)))
        if not added:
            return writes, 0
        needed = self.block_manager.num_new_blocks(self._as_writes(spec_writes))
        if needed > self.block_manager.device.num_free - self.watermark_blocks:
            for seq, _ in writes:
                self._proposals.pop(seq.seq_id, None)
            return writes, 0
        return spec_writes, added

    def _part_writes(
        self,
        group: SequenceGroup,
        live: list[Sequence],  # group.live_seqs(), as the step's loop has it
        budget: int,
        cap: int | None,
        decoding: bool,
    ) -> list[tuple[Sequence, int]] | None:
        """A deep chunk's next layer part (its tokens, again), or a new chunk planned in parts;
        [] when the part must wait a step (the budget is spent), None for the usual share. Only
        a group of one sequence, that scores no prompt logprobs, under the per-request cap."""
        if not self.context_read_rows or cap is None or len(live) != 1:
            return None
        seq = live[0]
        part = seq.layer_part
        uncomputed = seq.num_uncomputed_tokens
        if part is None and uncomputed <= 1 and seq.num_computed_tokens >= seq.prompt_len:
            return None  # a decode (most groups): its context read is its own, every step
        capped = decoding or self._others_queued(group)
        if part is None:
            if not capped or group.sampling.prompt_logprobs is not None:
                return None
            part = plan_layer_part(
                seq.num_computed_tokens, uncomputed, budget, cap, self.context_cost_tokens,
                self.context_read_rows, self.num_layers,
            )  # fmt: skip
            if part is None:
                return None
            seq.layer_part = part
        if part.num_tokens > budget:
            return []
        # Alone, the rest of the chunk's layers at once: no one waits on this step.
        step = part.layers_per_step if capped else self.num_layers
        part.step_end = min(self.num_layers, part.done + step)
        return [(seq, part.num_tokens)]

    def _share(self, group: SequenceGroup, budget: int, cap: int | None, decoding: bool) -> int:
        queued = functools.partial(self._others_queued, group)  # asked only under a cap
        return share(group, budget, cap, decoding, queued, self.context_cost_tokens)

    def _others_queued(self, group: SequenceGroup) -> bool:
        """Whether a group other than this one waits to start or resume."""
        heads = (
            self.waiting[0] if self.waiting else None,
            self.swapped[0] if self.swapped else None,
        )
        queued = len(self.waiting) + len(self.swapped)
        return queued > 1 or (queued == 1 and group not in heads)

    def _swap_in(
        self, budget: int, entries: list[PlanEntry], swap_in: list[tuple[int, int]]
    ) -> int | None:
        """Bring swapped[0] back; the tokens it computes, or None when it must wait."""
        group = self.swapped[0]
        writes = self._plan_writes(group, budget)
        if writes is None or not self._has_seats(group):
            return None
        if self._outgrows_rope_writes(writes):
            self.swapped.pop(0)
            self._recompute_for_rope(group)
            return 0
        seq_ids = [s.seq_id for s in group.live_seqs()]
        need = self.block_manager.num_blocks_of(seq_ids, cpu=True) + (
            self.block_manager.num_new_blocks(self._as_writes(writes), swapped=True)
        )
        if not self._fits(need):
            if not self.running and need > self.block_manager.device.num_blocks:
                self.swapped.pop(0)
                self._end_for_capacity(group)
                return 0
            return None
        self.swapped.pop(0)
        swap_in.extend(self.block_manager.swap_in(seq_ids))
        group.set_status(SeqStatus.RUNNING)
        self.policy.enqueue(self.running, group)
        return self._write(group, writes, entries)

    def _admit(
        self, budget: int, entries: list[PlanEntry], swap_in: list[tuple[int, int]]
    ) -> int | None:
        """Admit waiting[0] (new or recompute-preempted); its tokens, or None when it must wait."""
        group = self.waiting[0]
        # Looked up only; taken if the group is admitted.
        reused = self.prefix_reuse.lookup(self.block_manager, group)
        writes = self._plan_writes(group, budget, reused)
        if writes is None or not self._has_seats(group):
            return None
        # Admit only when the whole (re)computation fits above the watermark, so an admitted
        # group is not preempted right away. A group that outgrows even an idle pool ends
        # instead of blocking the queue. Cached blocks reused from the free ones count as taken.
        need = self.block_manager.admission_blocks(group, reused)
        if not self.running and need > self.block_manager.device.num_blocks:
            self.waiting.popleft()
            self._end_for_capacity(group)
            return 0
        # _can_write sees no reused block yet: they are whole blocks before the writes, so the
        # new blocks it counts are the same, and _fits has counted the free ones reuse takes.
        if not (
            self._fits(need)
            and self.block_manager.can_admit(group, need)
            and self._can_write(writes)
        ):
            return None
        self.waiting.popleft()
        self.prefix_reuse.take(self.block_manager, group, reused)
        self.block_manager.admit(group)
        group.set_status(SeqStatus.RUNNING)
        self.policy.enqueue(self.running, group)
        return self._write(group, writes, entries)

    def update(self, result: StepResult) -> list[GroupUpdate]:
        """Apply the executor's reply: advance counters, append tokens, fork, finish, free."""
        entries, victims = self.plans.take(result.step_id)
        updates = {u.group.request_id: u for u in self._pending_updates}
        self._pending_updates = []
        if result.error is not None:
            # A failure may come from inside the cache moves: the KV of this plan's swap-out
            # victims is not known to be on the CPU, so they are recomputed from their tokens.
            for group in victims:
                if group in self.swapped:
                    self.swapped.remove(group)
                    self._requeue_for_recompute(group)
            # The whole group ends, also samples that were not in this step, and children the
            # executor may already have created for a fork are forgotten there too.
            for entry in entries:
                self.plans.freed_seq_ids.extend(entry.fork_seq_ids)
                group = entry.group
                if group.is_finished:
                    continue  # aborted while the step ran: already reported once
                for seq in group.live_seqs():
                    self._finish(group, seq, "error")
                for queue in (self.running, self.swapped):
                    if group in queue:
                        queue.remove(group)
                updates.setdefault(group.request_id, GroupUpdate(group)).finished = True
            return list(updates.values())

        sampled = {t.seq_id: t for t in result.tokens}
        if self.speculation is not None:
            self.speculation.record(result.num_proposed, result.num_accepted)
            self.speculation.reported(result.step_id, entries)
            runs: dict[int, list[SampledToken]] = {}
            for token in result.tokens:  # a speculating sequence's tokens are consecutive
                runs.setdefault(token.seq_id, []).append(token)
        prompt_parts = {p.seq_id: p for p in result.prompt_logprobs}
        beam_groups: list[SequenceGroup] = []
        # Attributes read directly rather than through Sequence's properties: once per sequence
        # of every step, on the host's critical path.
        for entry in entries:
            seq, group = entry.seq, entry.group
            if seq.status is SeqStatus.FINISHED:  # aborted while the step ran
                self.plans.freed_seq_ids.extend(entry.fork_seq_ids)
                continue
            if entry.layers is not None:
                if entry.partial:  # the chunk's next part follows: nothing computed yet
                    if seq.layer_part is not None:
                        seq.layer_part.done = entry.layers[1]
                    continue
                seq.layer_part = None
            if entry.spec_tokens:
                update = updates.setdefault(group.request_id, GroupUpdate(group))
                run = runs[seq.seq_id]
                self.speculation.verified(seq.seq_id, len(entry.spec_tokens), len(run) - 1)
                self._take_verified(entry, run, update)
                self._remove_if_done(group, updates)
                continue
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.seq_id in prompt_parts:
                group.add_prompt_logprobs(prompt_parts[seq.seq_id])
            self.prefix_reuse.note_computed(self.block_manager, group, seq, entry.num_new_tokens)
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a non-final prompt chunk: nothing sampled
            if group.beam is not None:
                group.beam_draws[seq.seq_id] = sampled[seq.seq_id]
                if group not in beam_groups:
                    beam_groups.append(group)
                continue
            update = updates.get(group.request_id)
            if update is None:  # (not setdefault: that would build an update per sequence)
                update = updates[group.request_id] = GroupUpdate(group)
            if entry.fork_seq_ids:  # the children copy seq before its sampled token joins
                targets = [seq] + [self._fork(group, seq, cid) for cid in entry.fork_seq_ids]
                for target in targets:
                    self._append_sampled(group, target, sampled[target.seq_id], update)
                self._remove_if_done(group, updates)
            elif self._append_sampled(group, seq, sampled[seq.seq_id], update):
                self._remove_if_done(group, updates)  # only an ended sequence ends a group
        for group in beam_groups:
            if all(s.seq_id in group.beam_draws for s in group.live_seqs()):
                freed, done = advance_beams(group, self.block_manager, self._new_seq_id)
                self.plans.freed_seq_ids.extend(freed)
                if done:
                    self.groups.pop(group.request_id, None)
                self._remove_if_done(group, updates)  # results go out only at the end
        return list(updates.values())

    def _take_verified(
        self, entry: PlanEntry, tokens: list[SampledToken], update: GroupUpdate
    ) -> None:
        """A speculating sequence's step is reported: its accepted proposals and the token after
        them join it (up to the first that ends it); the K/V of the last real token and of the
        accepted proposals is valid, the rejected slots are rolled back (blocks past the valid
        positions return to the pool) and only full blocks of real tokens reach the prefix
        cache."""
        seq, group = entry.seq, entry.group
        start = seq.num_computed_tokens  # the last real token's position
        for token in tokens:
            if self._append_sampled(group, seq, token, update):
                return
        # Every token before the new last one has its K/V written: the last real token and the
        # accepted proposals (the new last token's own K/V is the next step's).
        seq.num_computed_tokens = start + len(tokens)
        self.block_manager.trim(seq.seq_id, seq.num_computed_tokens)
        self.prefix_reuse.note_computed(self.block_manager, group, seq, len(tokens))

    def _append_sampled(
        self, group: SequenceGroup, seq: Sequence, token: SampledToken, update: GroupUpdate
    ) -> bool:
        """One sampled token joins seq and the update; True when it ends seq (then finished)."""
        seq.token_ids.append(token.token_id)
        if group.sampling.logprobs is not None:
            seq.logprobs.append(token)
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
        update.new_tokens.append((seq, token))
        reason = check_stop(
            group.sampling, seq, token.token_id, self.eos_token_ids, self.max_seq_len
        )
        if reason is None:
            return False
        self._finish(group, seq, reason)
        return True

    # ---- helpers ------------------------------------------------------------------------------
    def _plan_writes(
        self, group: SequenceGroup, budget: int, reused: dict[int, list[int]] | None = None
    ) -> list[tuple[Sequence, int]] | None:
        """Tokens each live sequence computes this step, or None if none fits the budget.

        A sequence the budget cannot serve now (a prompt that chunking may not split) waits for
        a later step; its group is still preempted and recovered whole. `reused`: blocks a
        waiting group would take from the prefix cache; see PrefixReuse.starts.
        """
        writes = []
        for seq, computed in self.prefix_reuse.starts(self.block_manager, group, reused):
            uncomputed = seq.num_tokens - computed
            if self.config.enable_chunked_prefill:
                n = min(uncomputed, budget)
            else:
                n = uncomputed if uncomputed <= budget else 0
            if n > 0:
                budget -= n
                writes.append((seq, n))
        return writes or None

    def _as_writes(self, writes: list[tuple[Sequence, int]]) -> list[tuple[int, int, int]]:
        return [(s.seq_id, s.num_computed_tokens, n) for s, n in writes]

    def _has_seats(self, group: SequenceGroup) -> bool:
        return self.num_running_seqs + group.num_seats <= self.config.max_num_seqs

    def _fits(self, num_blocks: int) -> bool:
        """Whether taking num_blocks leaves the watermark free (or the pool is idle anyway)."""
        free = self.block_manager.device.num_free
        return num_blocks <= free - self.watermark_blocks or (
            not self.running and num_blocks <= free
        )

    def _end_for_capacity(self, group: SequenceGroup) -> None:
        """A group that cannot fit the whole pool even alone ends with "length", never loops."""
        for seq in group.live_seqs():
            self._finish(group, seq, "length")
        self._pending_updates.append(GroupUpdate(group, finished=True))

    def _can_write(self, writes: list[tuple[Sequence, int]]) -> bool:
        needed = self.block_manager.num_new_blocks(self._as_writes(writes))
        return needed <= self.block_manager.device.num_free

    def _outgrows_rope(self, seq: Sequence, end: int) -> bool:
        """Whether computing up to `end` takes a sequence whose K/V used longrope's short
        factors beyond the switch length."""
        switch = self.rope_switch_len
        return switch is not None and seq.num_computed_tokens > 0 and seq.rope_len <= switch < end

    def _outgrows_rope_writes(self, writes: list[tuple[Sequence, int]]) -> bool:
        if self.rope_switch_len is None:
            return False  # most models: no per-sequence test, every group of every step
        return any(self._outgrows_rope(seq, seq.num_computed_tokens + n) for seq, n in writes)

    def _recompute_for_rope(self, group: SequenceGroup) -> None:
        """Its K/V was computed with longrope's short factors: transformers recomputes the whole
        sequence with the long ones as it outgrows the switch length, and so do we."""
        self._requeue_for_recompute(group)
        self.num_rope_recomputes += 1

    def _may_outgrow_rope(self, group: SequenceGroup, num_proposals: int) -> bool:
        """Whether up to num_proposals proposed tokens could take a sequence of the group past
        the switch length on short-factor K/V (it does not speculate then: its run would need
        the recompute that schedule() makes only before a step)."""
        switch = self.rope_switch_len
        return switch is not None and any(
            s.rope_len <= switch < s.num_tokens + num_proposals for s in group.live_seqs()
        )

    def _write(
        self, group: SequenceGroup, writes: list[tuple[Sequence, int]], entries: list[PlanEntry]
    ) -> int:
        for seq, n in writes:
            if seq.num_computed_tokens == 0:
                seq.rope_len = seq.num_tokens
            self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            fork_ids: list[int] = []
            part = seq.layer_part
            layers = None if part is None else (part.done, part.step_end)
            partial = part is not None and part.step_end < self.num_layers
            finishes_prompt = seq.num_computed_tokens + n == seq.num_tokens and not partial
            num_samples = group.sampling.num_samples
            if finishes_prompt and num_samples > 1 and not group.forked and group.beam is None:
                fork_ids = [self._new_seq_id() for _ in range(num_samples - 1)]
                group.forked = True  # reserved now; the child sequences appear in update()
            spec = self._proposals.pop(seq.seq_id, [])
            entries.append(PlanEntry(seq, group, n, fork_ids, spec, layers, partial))
        return sum(n for _, n in writes)

    def _preempt(self, group: SequenceGroup, swap_out: list[tuple[int, int]]) -> bool:
        """Preempt a running group whole; True when it was swapped out (not recomputed)."""
        self.running.remove(group)
        self.num_preemptions += 1
        seq_ids = [s.seq_id for s in group.live_seqs()]
        blocks = self.block_manager.num_blocks_of(seq_ids)
        if self.config.preemption_mode == "swap" and blocks <= self.block_manager.cpu.num_free:
            swap_out.extend(self.block_manager.swap_out(seq_ids))
            group.set_status(SeqStatus.SWAPPED)
            self.policy.enqueue(self.swapped, group)
            return True
        self._requeue_for_recompute(group)
        return False

    def _requeue_for_recompute(self, group: SequenceGroup) -> None:
        # Recompute (also the fallback when the CPU pool is full): drop the KV, keep the tokens;
        # prompt and generated tokens are prefilled again as one longer prompt.
        for seq in group.live_seqs():
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
        group.set_status(SeqStatus.WAITING)
        self.policy.enqueue(self.waiting, group)

    def _fork(self, group: SequenceGroup, parent: Sequence, child_id: int) -> Sequence:
        child = Sequence(
            child_id,
            len(group.seqs),
            list(parent.token_ids),
            parent.prompt_len,
            num_computed_tokens=parent.num_computed_tokens,
            status=parent.status,
            announced=True,  # the executor derived its state when it sampled for it
            rope_len=parent.rope_len,
        )
        self.block_manager.fork(parent.seq_id, child_id)
        group.seqs.append(child)
        return child

    def _finish(self, group: SequenceGroup, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq.seq_id)
        self.plans.freed_seq_ids.append(seq.seq_id)
        if self.speculation is not None:
            self.speculation.forget(seq.seq_id)
        if group.is_finished:
            self.groups.pop(group.request_id, None)

    def _remove_if_done(self, group: SequenceGroup, updates: dict[str, GroupUpdate]) -> None:
        if group.is_finished:
            if group in self.running:
                self.running.remove(group)
            updates.setdefault(group.request_id, GroupUpdate(group)).finished = True

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1


def _plain_decode(live: list[Sequence], budget: int) -> list[tuple[Sequence, int]] | None:
    """[(seq, 1)] for a group of one running sequence decoding its last token with budget
    left (what the layer-part, row-cap and prompt-share paths all come to for it: none of
    them applies to such a decode), else None. Asked first for every group of every step,
    so that a batch of 256 decodes does not walk those paths 256 times."""
    if len(live) != 1 or budget <= 0:
        return None
    seq = live[0]
    computed = seq.num_computed_tokens
    if seq.layer_part is not None or computed + 1 != len(seq.token_ids):
        return None
    if computed < seq.prompt_len:
        return None  # a prompt's last token: its step may fork the samples, or run in parts
    return [(seq, 1)]
