"""Which sequences speculate in a step and what they propose; the acceptance counters.

The rule (docs/architecture.md, "Speculative decoding"): a step speculates only while the
running batch has at most --speculative-max-batch sequences (past that the batch itself fills
the step and K+1 rows per sequence cost more than they save). In such a step a decoding
sequence proposes tokens unless its request needs, inside the verified run, something that the
K+1 rows of one step cannot give it: beam search (it picks hypotheses from every draw), a
grammar (the mask of row i depends on the tokens before it), penalties or min_tokens (their
counts move with each accepted token), and prompt-lookup requests whose own tokens hold no
matching n-gram. Refusing speculation is always correct: the sequence decodes one token.
Past those rules, with --speculative-adaptive (the default), a sequence's proposals go into a
step only while they pay for their rows there (speculation_gate.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from services.scheduler.ngram_proposer import propose_ngram
from services.scheduler.sequence import Sequence, SequenceGroup
from services.scheduler.speculation_gate import SpeculationGate
from services.scheduler.stop_rules import max_output_tokens
from shared.config import SpeculativeConfig
from shared.protocol import DRAFT_TOKEN

if TYPE_CHECKING:
    from services.scheduler.step_plans import PlanEntry


def may_speculate(group: SequenceGroup) -> bool:
    """Whether the request's sampling lets its sequences verify several tokens in one step."""
    sampling = group.sampling
    return not (
        group.beam is not None
        or sampling.guided is not None
        or sampling.has_penalties
        or sampling.min_tokens > 0
    )


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.num_proposed = 0  # since start
        self.num_accepted = 0
        self.gate = SpeculationGate() if config.adaptive else None
        # The gate's step costs: plans that may speculate, step_id -> (when planned, whether a
        # sequence starts proposing in it), and who proposed in the last plan.
        self._planned_at: dict[int, tuple[float, bool]] = {}
        self._last_proposers: set[int] = set()

    def active(self, num_running_seqs: int) -> bool:
        """Whether this step speculates at all (the batch-size rule)."""
        return num_running_seqs <= self.config.max_batch

    def start_step(self, num_running_seqs: int, running: list[SequenceGroup], queued: bool) -> None:
        """A plan that may speculate begins (the gate's tally of the step); queued: requests
        wait to start or resume (then the step is not decodes alone)."""
        if self.gate is not None:
            decodes_only = not queued and all(
                s.num_uncomputed_tokens <= 1 for g in running for s in g.live_seqs()
            )
            self.gate.start_step(num_running_seqs, decodes_only)

    def propose(self, group: SequenceGroup, seq: Sequence, room: int) -> list[int]:
        """The proposals of a decoding sequence (at most `room` of them, and never past the
        tokens it may still generate: a step returns up to K + 1); [] for none."""
        remaining = max_output_tokens(group.sampling, seq.prompt_len, self.max_seq_len)
        k = min(self.config.num_tokens, room, remaining - seq.num_output_tokens - 1)
        if k <= 0 or not may_speculate(group):
            return []
        if self.config.method == "draft":
            proposals = [DRAFT_TOKEN] * k
        else:
            config = self.config
            proposals = propose_ngram(
                seq.token_ids, k, config.ngram_min, config.ngram_max,
                config.ngram_proposals_per_match,
            )  # fmt: skip
        if proposals and self.gate is not None:
            return proposals[: self.gate.admit(seq.seq_id, len(proposals))]
        return proposals

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted

    def planned(self, step_id: int, entries: list[PlanEntry] | None) -> None:
        """A plan was made: its entries where it may speculate, None where it may not (a
        lookahead plan, a batch past max_batch).

        The gate times such a step from its plan to its result: the executor's work and the
        trips both ways (at these batch sizes no step is planned ahead, so nothing else runs
        meanwhile). A step where a sequence starts proposing is a separate cost: a draft model
        first catches up there on every token since its last pass (a whole prompt, for a new
        sequence), a cost of starting, not of a proposal."""
        if self.gate is None:
            return
        if entries is None:
            self._last_proposers = set()
            return
        proposers = {e.seq.seq_id for e in entries if e.spec_tokens}
        if len(self._planned_at) > 8:  # steps never answered (a lost executor)
            self._planned_at.clear()
        starting = not proposers <= self._last_proposers
        self._planned_at[step_id] = (time.perf_counter(), starting)
        self._last_proposers = proposers

    def reported(self, step_id: int, entries: list[PlanEntry]) -> None:
        """A step's result arrived: a planned step of decodes alone times the gate's costs."""
        planned = self._planned_at.pop(step_id, None) if self.gate is not None else None
        if planned is None or not all(_decodes(e) for e in entries):
            return
        seconds = time.perf_counter() - planned[0]
        proposed = sum(len(e.spec_tokens) for e in entries)
        self.gate.step_timed(len(entries), proposed, seconds, planned[1])

    def verified(self, seq_id: int, proposed: int, accepted: int) -> None:
        if self.gate is not None:
            self.gate.verified(seq_id, proposed, accepted)

    def forget(self, seq_id: int) -> None:
        if self.gate is not None:
            self.gate.forget(seq_id)


def _decodes(entry: PlanEntry) -> bool:
    """Whether the entry is one decode row (with its proposals, if any)."""
    return entry.layers is None and entry.num_new_tokens == 1 + len(entry.spec_tokens)
