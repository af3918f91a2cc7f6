"""A structured-output request waits for its grammar outside every queue: plain requests run on
meanwhile, it joins in arrival order once compiled, and an error, a timeout or an abort ends it
alone without a block held."""

from __future__ import annotations

import pytest

from services.gateway.request_run import GenerationFailed
from services.scheduler.grammar_wait import ANSWER_GRACE_S
from services.scheduler.scheduler import Scheduler
from shared.config import GrammarConfig, SchedulerConfig
from shared.errors import InvalidRequestError, RateLimitError, ServiceUnavailableError
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams
from shared.structured import GrammarLimits

READY = ExecutorReady(64, 0, 4, 256, 100, (2,))
PLAIN = SamplingParams(max_tokens=50, ignore_eos=True)
GUIDED = SamplingParams(max_tokens=50, guided=("regex", "[a-z]+"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock | None = None) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), READY)
    if clock is not None:
        scheduler.grammar_waits._clock = clock
    return scheduler


def step(scheduler: Scheduler) -> set[str]:
    """Run one step where every sampled sequence draws token 5; the requests it scheduled."""
    plan = scheduler.schedule()
    owner = {s.seq_id: g.request_id for g in scheduler.groups.values() for s in g.seqs}
    tokens = [SampledToken(s.seq_id, 5) for s in plan.seqs if s.sample]
    scheduler.update(StepResult(plan.step_id, tokens))
    return {owner[s.seq_id] for s in plan.seqs}


def test_a_grammar_request_waits_for_its_compile_while_plain_requests_run() -> None:
    scheduler = make_scheduler()
    scheduler.add_request("plain-1", [3, 4, 5], PLAIN)
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    scheduler.add_request("plain-2", [6, 7, 8], PLAIN)
    [request] = scheduler.take_compile_requests()
    assert (request.kind, request.spec) == GUIDED.guided
    assert request.seq_ids == [scheduler.groups["guided"].seqs[0].seq_id]
    assert scheduler.take_compile_requests() == []  # asked once
    for _ in range(3):
        assert step(scheduler) == {"plain-1", "plain-2"}
    assert scheduler.has_schedulable() and "guided" not in {g.request_id for g in scheduler.waiting}
    assert scheduler.grammar_compiled(request.key, None) is None
    assert [g.request_id for g in scheduler.waiting] == ["guided"]
    assert step(scheduler) == {"plain-1", "guided", "plain-2"}
    assert [g.request_id for g in scheduler.running] == ["plain-1", "guided", "plain-2"]


def test_a_compiled_grammar_joins_the_queue_in_arrival_order() -> None:
    # One seat: plain requests queue behind each other; the grammar request, older than the
    # last of them, is admitted before it once compiled.
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), READY)
    short = SamplingParams(max_tokens=1, ignore_eos=True)
    scheduler.add_request("a", [3, 4], short)
    scheduler.add_request("guided", [3, 4], GUIDED)
    scheduler.add_request("b", [3, 4], short)
    [request] = scheduler.take_compile_requests()
    assert step(scheduler) == {"a"}
    scheduler.grammar_compiled(request.key, None)
    assert [g.request_id for g in scheduler.waiting] == ["guided", "b"]


def test_a_compile_error_ends_that_request_alone_with_an_invalid_request_error() -> None:
    scheduler = make_scheduler()
    free = scheduler.block_manager.device.num_free
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    scheduler.add_request("plain", [3, 4, 5], PLAIN)
    [request] = scheduler.take_compile_requests()
    step(scheduler)
    update = scheduler.grammar_compiled(request.key, "invalid regex constraint: bad")
    assert update.finished and update.group.request_id == "guided"
    assert update.error["type"] == "invalid_request_error"
    assert update.error["message"] == "invalid regex constraint: bad"
    assert "guided" not in scheduler.groups and len(scheduler.grammar_waits) == 0
    assert step(scheduler) == {"plain"}  # the other request runs on
    scheduler.abort("plain")
    assert scheduler.block_manager.device.num_free == free
    # A late answer for it (or any unknown key) is ignored.
    assert scheduler.grammar_compiled(request.key, None) is None


@pytest.mark.parametrize(
    "error_type", ["rate_limit_error", "service_unavailable_error", "invalid_request_error"]
)
def test_a_compile_answer_ends_its_request_with_the_error_type_it_names(error_type):
    # rate_limit_error (429): it waited behind other compiles past the limit; retry later.
    scheduler = make_scheduler()
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    [request] = scheduler.take_compile_requests()
    update = scheduler.grammar_compiled(request.key, "why", error_type)
    assert update.finished and update.error["type"] == error_type


def test_a_compile_not_answered_in_time_ends_that_request_alone_with_a_503() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    free = scheduler.block_manager.device.num_free
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    scheduler.add_request("plain", [3, 4, 5], PLAIN)
    scheduler.take_compile_requests()
    limit = GrammarConfig().compile_timeout_s
    clock.now = limit + ANSWER_GRACE_S - 0.1
    assert scheduler.expire_grammar_waits() == []
    clock.now = limit + ANSWER_GRACE_S + 0.1
    [update] = scheduler.expire_grammar_waits()
    assert update.finished and update.group.request_id == "guided"
    # The executor answers a compile past its limit itself (a 400): no answer at all is the
    # server's fault (compiles queued ahead, a stuck executor), not the spec's.
    assert update.error["type"] == "service_unavailable_error"
    assert update.error["code"] == "grammar_compiler_busy"
    assert f"{limit + ANSWER_GRACE_S:g} s" in update.error["message"]
    assert list(scheduler.groups) == ["plain"]
    # The executor is told at once, not with the next plan: it stops the compile.
    assert scheduler.take_grammar_forgets() == [update.group.seqs[0].seq_id]
    # Its sequence is freed at the executor too (a grammar held for it is dropped there).
    plan = scheduler.schedule()
    assert update.group.seqs[0].seq_id in plan.freed_seq_ids
    scheduler.update(StepResult(plan.step_id, [SampledToken(s.seq_id, 5) for s in plan.seqs]))
    scheduler.abort("plain")
    assert scheduler.block_manager.device.num_free == free


def test_an_abort_while_compiling_frees_everything() -> None:
    scheduler = make_scheduler()
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    [request] = scheduler.take_compile_requests()
    update = scheduler.abort("guided")
    # Told to the executor now: no plan may follow (nothing else runs) to carry it.
    assert scheduler.take_grammar_forgets() == request.seq_ids
    assert scheduler.take_grammar_forgets() == []
    assert update.finished and update.group.seqs[0].finish_reason == "abort"
    assert not scheduler.groups and len(scheduler.grammar_waits) == 0
    assert not scheduler.has_unfinished() and not scheduler.has_schedulable()
    assert scheduler.grammar_compiled(request.key, None) is None
    assert not scheduler.waiting


def test_an_abort_before_the_request_is_sent_drops_its_compile_request() -> None:
    scheduler = make_scheduler()
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    scheduler.abort("guided")
    assert scheduler.take_compile_requests() == []


def test_a_new_executor_is_asked_again_for_every_grammar_still_needed() -> None:
    scheduler = make_scheduler()
    scheduler.add_request("running", [3, 4, 5], GUIDED)
    scheduler.add_request("compiling", [3, 4, 5], GUIDED)
    scheduler.add_request("plain", [3, 4, 5], PLAIN)
    first, _ = scheduler.take_compile_requests()
    scheduler.grammar_compiled(first.key, None)
    assert step(scheduler) == {"running", "plain"}
    scheduler.requeue_all(READY)
    again = scheduler.take_compile_requests()
    assert [scheduler.grammar_waits.answered(r.key).request_id for r in again] == [
        "running",
        "compiling",
    ]
    assert [g.request_id for g in scheduler.waiting] == ["plain"]


def test_requests_over_the_grammar_limits_are_refused_at_intake() -> None:
    limits = GrammarLimits(max_spec_bytes=64, max_choices=3)
    scheduler = Scheduler(SchedulerConfig(), READY, GrammarConfig(limits=limits))
    choices = SamplingParams(guided=("choice", '["a", "b", "c", "d"]'))
    with pytest.raises(InvalidRequestError, match="at most 3 choices"):
        scheduler.add_request("r", [3, 4], choices)
    big = SamplingParams(guided=("regex", "a" * 65))
    with pytest.raises(InvalidRequestError, match="--max-grammar-spec-bytes"):
        scheduler.add_request("r", [3, 4], big)
    assert not scheduler.groups and scheduler.take_compile_requests() == []


def test_the_deadline_starts_when_the_compile_is_sent() -> None:
    # While the executor is down nothing is sent: its replacement's compile gets a full limit.
    clock = Clock()
    scheduler = make_scheduler(clock)
    scheduler.add_request("guided", [3, 4, 5], GUIDED)
    clock.now = 1000.0
    assert scheduler.expire_grammar_waits() == []
    scheduler.take_compile_requests()
    clock.now += GrammarConfig().compile_timeout_s + ANSWER_GRACE_S - 0.1
    assert scheduler.expire_grammar_waits() == []
    clock.now += 0.2
    assert len(scheduler.expire_grammar_waits()) == 1


def test_a_compiler_failure_is_a_503_and_an_invalid_spec_a_400() -> None:
    scheduler = make_scheduler()
    scheduler.add_request("crashed", [3, 4, 5], GUIDED)
    scheduler.add_request("invalid", [3, 4, 5], GUIDED)
    crashed, invalid = scheduler.take_compile_requests()
    update = scheduler.grammar_compiled(crashed.key, "it crashed", "service_unavailable_error")
    assert update.error["type"] == "service_unavailable_error"
    update = scheduler.grammar_compiled(invalid.key, "invalid regex constraint: ...")
    assert update.error["type"] == "invalid_request_error"


def guided(pattern: str) -> SamplingParams:
    return SamplingParams(max_tokens=50, guided=("regex", pattern))


def test_grammar_requests_past_max_pending_are_refused_with_a_429() -> None:
    scheduler = Scheduler(SchedulerConfig(), READY, GrammarConfig(max_pending=2))
    scheduler.add_request("a", [3, 4], guided("a+"))
    scheduler.add_request("b", [3, 4], guided("b+"))
    with pytest.raises(RateLimitError, match="--max-pending-grammars") as refused:
        scheduler.add_request("c", [3, 4], guided("c+"))
    assert refused.value.http_status == 429 and "c" not in scheduler.groups
    scheduler.add_request("plain", [3, 4], PLAIN)  # plain requests are not bounded by it
    # Nor are requests for a grammar already waited for: they cost no compile of their own.
    for i in range(5):
        scheduler.add_request(f"a{i}", [3, 4], guided("a+"))
    scheduler.abort("a")
    with pytest.raises(RateLimitError):  # a+ is still waited for (by a0..a4)
        scheduler.add_request("c", [3, 4], guided("c+"))
    scheduler.abort("b")
    scheduler.add_request("c", [3, 4], guided("c+"))  # room again


def test_the_gateway_answers_the_schedulers_new_errors_with_their_statuses() -> None:
    busy = ServiceUnavailableError("the grammar compiler is busy", code="grammar_compiler_busy")
    assert GenerationFailed(busy.to_dict()["error"]).status == 503
    full = RateLimitError("too many grammars wait", param="guided")
    assert GenerationFailed(full.to_dict()["error"]).status == 429
