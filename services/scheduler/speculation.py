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

from services.scheduler.ngram_proposer import propose_ngram
from services.scheduler.sequence import Sequence, SequenceGroup
from services.scheduler.speculation_gate import SpeculationGate
from services.scheduler.stop_rules import max_output_tokens
from shared.config import SpeculativeConfig
from shared.protocol import DRAFT_TOKEN


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

    def active(self, num_running_seqs: int) -> bool:
        """Whether this step speculates at all (the batch-size rule)."""
        return num_running_seqs <= self.config.max_batch

    def start_step(self, num_running_seqs: int, decodes_only: bool) -> None:
        """A plan that may speculate begins (the gate's tally of the step); decodes_only: it
        holds no prompt tokens (see SpeculationGate.start_step)."""
        if self.gate is not None:
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

    def verified(self, seq_id: int, proposed: int, accepted: int) -> None:
        if self.gate is not None:
            self.gate.verified(seq_id, proposed, accepted)

    def step_timed(
        self, num_seqs: int, num_proposed: int, seconds: float, starting: bool = False
    ) -> None:
        """A decode-only step's time, plan to result (the gate's step costs)."""
        if self.gate is not None:
            self.gate.step_timed(num_seqs, num_proposed, seconds, starting)

    def forget(self, seq_id: int) -> None:
        if self.gate is not None:
            self.gate.forget(seq_id)
