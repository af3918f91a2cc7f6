"""One beam-search group's bookkeeping: which continuations live on, which hypotheses are done.

The rules are transformers' `generate(num_beams=W, do_sample=False)` (its vectorised beam search),
so that our W results equal its W results token for token:
- every step the best K = max(2, 1 + number of stop tokens) x W continuations over all live beams
  are ranked by cumulative logprob;
- a continuation that ends (a stop token, or the length limit) among the first W of those K
  becomes a finished hypothesis scored cumulative_logprob / generated_len ** length_penalty,
  unless the finished set is already full with early_stopping=True, or no improvement is
  possible any more; the W best finished hypotheses are kept;
- the W best continuations that did not end are the next step's beams;
- the search stops when no running beam can beat the worst kept hypothesis (the heuristic of
  early_stopping False / "never"), when W hypotheses are kept under early_stopping=True, or when
  every one of the K continuations ended.

BeamSearch knows nothing of blocks: it returns which parent each new beam extends, and
advance_beams applies that to the group's sequences, forking and freeing their block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.scheduler.sequence import SeqStatus, Sequence, SequenceGroup
from shared.protocol import SampledToken
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from services.scheduler.block_manager import BlockManager

NEG_INF = -1.0e9  # transformers' "impossible" score; kept so comparisons behave the same


@dataclass(frozen=True)
class Candidate:
    """One continuation: beam `parent` (an index into the live beams) extended by `token_id`."""

    parent: int
    token_id: int
    logprob: float  # of token_id alone
    score: float  # the parent's cumulative logprob + logprob


@dataclass
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens only, the ending token included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" | "length"
    last: Candidate  # its final continuation; last.parent is the live beam it extends
    seq: Any = None  # the scheduler's finished Sequence for it, made right after the step


@dataclass
class BeamStep:
    """What one step decided."""

    beams: list[Candidate]  # the next live beams, best first
    done: bool  # the search is over: the group's result is `BeamSearch.finished`


@dataclass
class BeamSearch:
    params: SamplingParams
    stop_token_ids: frozenset[int]  # tokens that end a hypothesis (eos unless ignored, stop ids)
    max_output_len: int  # generated tokens at most (max_tokens, or what the context leaves)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    _improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied

    @property
    def width(self) -> int:
        return self.params.n

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def step(
        self,
        beam_scores: list[float],
        beam_outputs: list[list[int]],
        top_logprobs: list[list[tuple[int, float]]],
    ) -> BeamStep:
        """Advance every live beam by one token.

        beam_scores[b]: beam b's cumulative logprob; beam_outputs[b]: its generated tokens so far
        (all beams have the same number); top_logprobs[b]: its best next tokens with their
        logprobs, at least num_candidates of them, best first.
        """
        width, k = self.width, self.num_candidates
        generated = len(beam_outputs[0]) + 1  # the length every continuation reaches
        # Scores are summed in fp32, as transformers keeps them, so near-ties break alike.
        candidates = [
            Candidate(b, token, lp, float(np.float32(beam_scores[b]) + np.float32(lp)))
            for b, row in enumerate(top_logprobs)
            for token, lp in row[:k]
        ]
        # torch.topk over the flattened [beams x vocab] scores: best first, lower index on ties.
        candidates.sort(key=lambda c: (-c.score, c.parent, c.token_id))
        top = candidates[:k]
        at_limit = generated >= self.max_output_len
        ends = [at_limit or c.token_id in self.stop_token_ids for c in top]

        running = [c for c, end in zip(top, ends) if not end][:width]
        self._add_finished(top, ends, beam_outputs, generated)

        best_running = running[0].score if running else NEG_INF
        self._update_improvable(best_running, generated)
        full = len(self.finished) == width
        done = (
            not self._improvable
            or (full and self.params.early_stopping is True)
            or all(ends)
            or not running
        )
        return BeamStep(running, done)

    def _add_finished(
        self,
        top: list[Candidate],
        ends: list[bool],
        beam_outputs: list[list[int]],
        generated: int,
    ) -> None:
        width = self.width
        full = len(self.finished) == width
        if (full and self.params.early_stopping is True) or not self._improvable:
            return
        penalty = generated**self.params.length_penalty  # a Python float, as in transformers
        added = False
        for rank, (cand, end) in enumerate(zip(top, ends)):
            # Only the best `width` continuations may finish; the rest exist so that `width`
            # beams survive even when the best ones all end.
            if rank >= width or not end:
                continue
            reason = "length" if cand.token_id not in self.stop_token_ids else "stop"
            tokens = (*beam_outputs[cand.parent], cand.token_id)
            self.finished.append(
                Hypothesis(tokens, cand.score, _f32_div(cand.score, penalty), reason, cand)
            )
            added = True
        if added:
            # transformers merges old and new with torch.topk: the old ones win ties.
            order = sorted(range(len(self.finished)), key=lambda i: (-self.finished[i].score, i))
            self.finished = [self.finished[i] for i in order[:width]]

    def _update_improvable(self, best_running: float, generated: int) -> None:
        """Whether a running beam could still beat the worst kept hypothesis."""
        if not self._improvable:
            return
        if len(self.finished) < self.width:
            return  # an empty slot always loses to a running beam
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            best_len = self.max_output_len
        else:
            best_len = generated
        best_possible = _f32_div(best_running, best_len**self.params.length_penalty)
        self._improvable = best_possible > min(h.score for h in self.finished)


def _f32_div(score: float, divisor: float) -> float:
    """An fp32 score divided by a Python float, rounded to fp32 as a torch tensor would be."""
    return float(np.float32(np.float32(score) / np.float32(divisor)))


# ---- the group's sequences and blocks -----------------------------------------------------------
def advance_beams(
    group: SequenceGroup, block_manager: BlockManager, new_seq_id: Callable[[], int]
) -> tuple[list[int], bool]:
    """Every live beam has drawn: keep the best continuations as the new beams (a parent
    kept twice is forked: its blocks shared, its last block copied on the next write),
    free the dropped beams' blocks, and end the group once the search is over (its sequences
    are then the kept hypotheses, best first). Returns the freed sequence ids (the executor may
    forget them) and whether the search is over."""
    beams = group.live_seqs()
    draws = [group.beam_draws.pop(s.seq_id) for s in beams]
    outcome = group.beam.step(
        [s.cumulative_logprob for s in beams],
        [s.output_token_ids for s in beams],
        [d.top_logprobs for d in draws],
    )
    want_logprobs = group.sampling.logprobs is not None

    def extended(cand: Candidate, seq: Sequence) -> None:
        seq.token_ids.append(cand.token_id)
        seq.cumulative_logprob = cand.score
        if want_logprobs:
            top = draws[cand.parent].top_logprobs[: group.sampling.logprobs]
            seq.logprobs.append(SampledToken(seq.seq_id, cand.token_id, cand.logprob, top))

    for hyp in group.beam.finished:
        if hyp.seq is None:  # finished this step: its parent beam is still `beams`
            parent = beams[hyp.last.parent]
            hyp.seq = Sequence(-1, 0, list(parent.token_ids), parent.prompt_len)
            hyp.seq.logprobs = list(parent.logprobs)
            extended(hyp.last, hyp.seq)
            hyp.seq.status, hyp.seq.finish_reason = SeqStatus.FINISHED, hyp.finish_reason

    freed: list[int] = []
    kept: set[int] = set()
    new_beams: list[Sequence] = []
    for cand in outcome.beams if not outcome.done else []:
        parent = beams[cand.parent]
        if cand.parent in kept:  # a second continuation of the same parent: fork it
            child = Sequence(
                new_seq_id(),
                0,
                parent.token_ids[:-1],  # the parent has taken its own token already
                parent.prompt_len,
                num_computed_tokens=parent.num_computed_tokens,
                status=parent.status,
                logprobs=parent.logprobs[:-1] if want_logprobs else [],
            )
            block_manager.fork(parent.seq_id, child.seq_id)
        else:
            kept.add(cand.parent)
            child = parent
        extended(cand, child)
        new_beams.append(child)
    for i, seq in enumerate(new_beams):
        seq.index = i
    for i, seq in enumerate(beams):
        if i not in kept:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "beam_dropped"
            block_manager.free(seq.seq_id)
            freed.append(seq.seq_id)
    if outcome.done:
        group.seqs = [hyp.seq for hyp in group.beam.finished]
        for i, seq in enumerate(group.seqs):
            seq.index = i
    else:
        group.seqs = new_beams
    return freed, outcome.done
