"""Sequences and sequence groups: token lists and the computed-vs-total counters of the policy."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.layer_parts import LayerPart
from shared.protocol import PromptLogprobs, SampledToken
from shared.sampling import SamplingParams

if TYPE_CHECKING:  # beam_search.py works on sequences: importing it here would be a cycle
    from services.scheduler.beam_search import BeamSearch


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted by recompute
    RUNNING = "running"  # KV (partly) resident in device blocks
    SWAPPED = "swapped"  # preempted by swap: KV lives in CPU blocks
    FINISHED = "finished"


# eq=False: queues find and remove sequences and groups by identity (`in`, `remove`), never by
# comparing their token lists.
@dataclass(eq=False)
class Sequence:
    seq_id: int
    index: int  # position among the group's parallel samples (0 for the first)
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[SampledToken] = field(default_factory=list)  # one per output token, if asked
    cumulative_logprob: float = 0.0  # sum of the output tokens' logprobs (when they are drawn)
    announced: bool = False  # the executor has this sequence's sampling state
    # num_tokens when its K/V was last computed from position 0: longrope chose its tables by
    # it (Scheduler._outgrows_rope).
    rope_len: int = 0
    # A deep prompt chunk being computed a few layers per step (layer_parts.py); it lives only
    # while the sequence runs: preempted, the chunk starts again from its first layer.
    layer_part: LayerPart | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(eq=False)
class SequenceGroup:
    """All sequences of one request; scheduled, preempted and recovered as a unit."""

    request_id: str
    arrival: int  # arrival order, the FCFS key
    sampling: SamplingParams
    seqs: list[Sequence]
    forked: bool = False  # n > 1: whether the parallel samples exist yet
    # Beam search only: the search's state, and each live beam's drawn top logprobs of this
    # beam step (a beam step runs once every live beam has drawn; after a recompute they may
    # finish their prefills in different steps).
    beam: BeamSearch | None = None
    beam_draws: dict[int, SampledToken] = field(default_factory=dict)
    # Asked-for prompt logprobs as they arrive, positions 1 .. in order (sequence 0's); a
    # recomputed prompt's repeats are dropped. Sent once, whole.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    def next_prompt_logprob_pos(self) -> int:
        """The first prompt position whose logprob has not arrived."""
        scored = self.prompt_logprobs
        return 1 if scored is None else 1 + len(scored.tokens)

    def add_prompt_logprobs(self, part: PromptLogprobs) -> None:
        """Keep the part's positions not seen yet; results arrive in plan order."""
        skip = self.next_prompt_logprob_pos() - part.start_pos
        if skip < 0:
            raise ValueError(f"{self.request_id}: prompt logprobs arrived with a gap")
        if self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs(part.seq_id, 1, [], [])
        self.prompt_logprobs.tokens.extend(part.tokens[skip:])
        self.prompt_logprobs.ranks.extend(part.ranks[skip:])

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.next_prompt_logprob_pos() >= self.seqs[0].prompt_len

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].token_ids[: self.seqs[0].prompt_len]

    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # most groups, several times a step each: no comprehension
            return [] if seqs[0].status is SeqStatus.FINISHED else [seqs[0]]
        return [s for s in seqs if s.status is not SeqStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    @property
    def num_seats(self) -> int:
        """Sequences this group may run at once: seats for every sample are held until the
        samples exist."""
        seqs = self.seqs
        num_samples = self.sampling.num_samples
        if len(seqs) == 1 and num_samples == 1:  # most groups: summed over all, every step
            return 0 if seqs[0].status is SeqStatus.FINISHED else 1
        if len(seqs) < num_samples and not self.is_finished:
            return num_samples
        return len(self.live_seqs())

    def reported_seqs(self) -> list[tuple[int, Sequence]]:
        """(index the client sees, sequence) of the samples a response shows.

        With best_of > n nothing is shown until every candidate has ended; then the n with the
        highest cumulative logprob, best first, as indices 0 .. n-1.
        """
        if self.beam is not None:
            # Once ended, seqs are the kept hypotheses, best first.
            return list(enumerate(self.seqs)) if self.is_finished else []
        if self.sampling.num_samples == self.sampling.n:
            return [(s.index, s) for s in self.seqs]
        if not self.is_finished:
            return []
        ranked = sorted(self.seqs, key=lambda s: (-s.cumulative_logprob, s.index))
        return list(enumerate(ranked[: self.sampling.n]))

    def set_status(self, status: SeqStatus) -> None:
        for seq in self.live_seqs():
            seq.status = status
            if status is not SeqStatus.RUNNING:
                seq.layer_part = None
