"""The speculation gate: proposals join a step only while their measured acceptance and cost
raise its expected tokens per second; it explores costs it does not know and probes refused
sequences again with one proposal, as often as a share of the time allows and less often each
time a probe is rejected."""

from __future__ import annotations

import pytest

from services.scheduler.speculation_gate import (
    COST_EMA,
    MAX_DOUBLINGS,
    REFRESH_PLAIN,
    SpeculationGate,
    expected_tokens,
)
from shared.config import SpeculativeConfig
from tests.support.scheduler_steps import add, make_scheduler, step


def test_expected_tokens_of_a_verify_step():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


def _measured(plain_s: float, per_proposal_s: float) -> SpeculationGate:
    """A gate that has timed a plain step and one with three proposals at batch 1."""
    gate = SpeculationGate()
    gate.step_timed(1, 0, plain_s)
    gate.step_timed(1, 3, plain_s + 3 * per_proposal_s)
    return gate


def _refusals_until_taken(gate: SpeculationGate, seq_id: int) -> int:
    """Steps of one sequence at batch 1 refused before its proposals are taken (a probe)."""
    refused = 0
    gate.start_step(1, True)
    while not gate.admit(seq_id, 3):
        refused += 1
        gate.start_step(1, True)
    return refused


def test_costs_are_learnt_plain_first_then_with_proposals():
    gate = SpeculationGate()
    gate.start_step(1, False)
    assert gate.admit(7, 3)  # nothing known, and a prompt chunk in the step: as without a gate
    gate.start_step(1, True)
    assert not gate.admit(7, 3)  # decodes alone: a plain step times T(1, 0)
    gate.step_timed(1, 0, 0.010)
    gate.start_step(1, True)
    assert gate.admit(7, 3)  # the cost of proposals unknown: this step times it
    gate.step_timed(1, 3, 0.013)
    assert gate.proposal_seconds[1] == pytest.approx(0.001)
    # A batch size never timed borrows the nearest one's costs: no plain step needed first.
    gate.start_step(2, False)
    assert gate.admit(7, 3)
    assert gate._tokens > 2.0  # judged by the rule (the prior a = 0.5), not as exploration


def test_plain_steps_are_timed_again_as_the_context_grows():
    gate = _measured(0.010, 0.001)
    for _ in range(REFRESH_PLAIN - 1):
        gate.start_step(1, True)
        assert gate.admit(7, 3)
        gate.step_timed(1, 3, 0.013)
    gate.start_step(1, True)
    assert not gate.admit(7, 3)  # REFRESH_PLAIN speculating steps since T(1, 0): time it again
    gate.step_timed(1, 0, 0.012)
    assert gate.plain_seconds[1] == pytest.approx(0.010 + COST_EMA * 0.002)
    gate.start_step(1, True)
    assert gate.admit(7, 3)


def test_cheap_rows_and_fair_acceptance_speculate():
    gate = _measured(0.010, 0.001)
    gate.start_step(1, True)
    # a = 0.5 (no evidence yet): 1.875 tokens for 13 ms against 1 token for 10 ms.
    assert gate.admit(7, 3)


def test_a_draft_that_never_agrees_stops_speculating_and_is_probed_less_often():
    gate = _measured(0.010, 0.001)
    refused_after = None
    for n in range(6):
        gate.start_step(1, True)
        if not gate.admit(7, 3):
            refused_after = n
            break
        gate.verified(7, 3, 0)
    assert refused_after is not None and refused_after <= 3
    # A probe costs 1 ms a step of 10 ms: one every 2 refused steps keeps probes within 5% of
    # the time; each rejected probe doubles the wait, at most 3 times.
    waits = []
    for _ in range(5):
        refused = 0
        gate.start_step(1, True)
        while not (taken := gate.admit(7, 3)):
            refused += 1
            gate.start_step(1, True)
        assert taken == 1  # a probe proposes one token: enough to see it rejected
        gate.verified(7, 1, 0)
        waits.append(refused)
    assert waits == [1, 4, 8, 16, 16]  # the first wait counts from the refusal above
    assert gate.num_refused >= 3 * sum(waits)


def test_costly_proposals_are_probed_rarely():
    gate = _measured(0.010, 0.010)  # a proposal costs what a whole step does
    for _ in range(3):
        gate.verified(7, 3, 0)
    assert _refusals_until_taken(gate, 7) == 20


def test_an_accepted_probe_resets_the_wait():
    gate = _measured(0.010, 0.001)
    for _ in range(5):
        gate.start_step(1, True)
        gate.admit(7, 3)
        gate.verified(7, 3, 0)
    stats = gate._seqs[7]
    stats.rejected_probes = MAX_DOUBLINGS
    stats.refused = 100
    gate.start_step(1, True)
    assert gate.admit(7, 3) == 1 and stats.probing
    gate.verified(7, 1, 1)  # the text turned repetitive
    assert stats.rejected_probes == 0


def test_costly_proposals_are_refused_even_when_mostly_accepted():
    # A draft whose passes cost as much as the target step per proposal: even at a = 0.9,
    # 3.44 tokens for 40 ms lose to 1 token per 10 ms.
    gate = _measured(0.010, 0.010)
    for _ in range(20):
        gate.verified(1, 3, 3)
        gate.verified(1, 3, 2)
    gate.start_step(1, True)
    assert gate.acceptance(gate._seqs[1]) > 0.7
    assert not gate.admit(1, 3)


def test_a_new_sequence_starts_from_the_methods_recent_acceptance():
    gate = _measured(0.010, 0.001)
    for _ in range(30):
        gate.verified(1, 3, 0)  # the method has been earning nothing
    gate.start_step(1, True)
    assert not gate.admit(2, 3)  # a sequence never seen before is refused at once


def test_the_tally_counts_proposals_already_in_the_step():
    gate = SpeculationGate()
    gate.step_timed(2, 0, 0.010)
    gate.step_timed(2, 3, 0.013)  # 1 ms per proposal
    for seq_id in (1, 2):
        for _ in range(10):
            gate.verified(seq_id, 3, 1)  # a = 0.5
    gate.start_step(2, True)
    assert gate.admit(1, 3)
    # The second sequence's rows are judged against a step that already holds the first's.
    assert gate._proposed == 3 and gate._tokens > 2.0
    gate.forget(1)
    assert 1 not in gate._seqs


def test_a_sequences_first_speculating_step_is_timed_as_a_start():
    """A draft model catches up on every token since its last pass in a sequence's first
    speculating step (a whole prompt, for a new one): that step's extra time is a cost of
    starting, not of its proposals, and it lengthens the wait between probes."""
    spec = SpeculativeConfig(method="draft", num_tokens=3, draft_model="d")
    scheduler = make_scheduler(block_size=4, speculative=spec)
    timed: list[tuple[int, int, bool]] = []
    gate = scheduler.speculation.gate
    learn = gate.step_timed

    def record(num_seqs: int, num_proposed: int, seconds: float, starting: bool) -> None:
        timed.append((num_seqs, num_proposed, starting))
        learn(num_seqs, num_proposed, seconds, starting)

    gate.step_timed = record
    add(scheduler, "r", 4, max_tokens=12)
    proposed = []
    for _ in range(4):  # the prompt, a plain decode, then two speculating steps
        plan, _ = step(scheduler)
        proposed.append(sum(s.num_spec_tokens for s in plan.seqs))
    assert proposed == [0, 0, 3, 3]
    assert timed == [(1, 0, False), (1, 3, True), (1, 3, False)]


def test_the_cost_of_a_start_lengthens_the_wait_between_probes():
    gate = _measured(0.010, 0.001)
    gate.step_timed(1, 3, 0.013 + 0.019, starting=True)  # 19 ms of catch-up
    assert gate.start_seconds[1] == pytest.approx(0.019)
    assert gate.proposal_seconds[1] == pytest.approx(0.001)  # unchanged by the start
    for _ in range(3):
        gate.verified(7, 3, 0)
    assert _refusals_until_taken(gate, 7) == 40  # (1 + 19) ms within 5% of 10 ms steps
