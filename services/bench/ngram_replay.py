"""Offline replay of n-gram speculation over recorded greedy outputs: what the scheduler's own
proposer would propose at every step and how much of it greedy verification would accept.

A greedy request's output does not depend on speculation (verification keeps the target's own
argmax), so one recorded output stream stands for every setting: at each verify step the
proposals are looked up in the tokens known so far (prompt and the output up to here), accepted
while they equal the recorded next tokens, and the step yields the accepted ones plus the
target's own next token, exactly as Scheduler._take_verified does. The proposals come from
Speculation.propose itself, so its caps (K, max_tokens) and policy are the ones served.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.sequence import Sequence, SequenceGroup
from services.scheduler.speculation import Speculation
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams


@dataclass
class ReplayCounts:
    num_steps: int = 0  # decode steps after the prefill (each verifies or decodes one token)
    num_speculating_steps: int = 0  # steps that proposed at least one token
    num_proposed: int = 0
    num_accepted: int = 0
    num_tokens: int = 0  # output tokens those steps produced (the prefill's first one excluded)

    def add(self, other: ReplayCounts) -> None:
        self.num_steps += other.num_steps
        self.num_speculating_steps += other.num_speculating_steps
        self.num_proposed += other.num_proposed
        self.num_accepted += other.num_accepted
        self.num_tokens += other.num_tokens

    def summary(self, verify_row_cost: float) -> dict:
        """Rates and a projected TPOT ratio to plain decoding, assuming a step that verifies k
        proposals costs (1 + verify_row_cost * k) plain decode steps (an assumption: on the
        CPU a one-sequence step is bound by reading the weights, so extra rows cost little)."""
        return {
            **vars(self),
            "acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else None,
            "tokens_per_step": self.num_tokens / self.num_steps if self.num_steps else None,
            "speculating_step_fraction": (
                self.num_speculating_steps / self.num_steps if self.num_steps else None
            ),
            "accepted_per_token": self.num_accepted / self.num_tokens if self.num_tokens else None,
            "projected_tpot_ratio": self.projected_tpot_ratio(verify_row_cost),
        }

    def projected_tpot_ratio(self, verify_row_cost: float) -> float | None:
        """Time per output token over plain decoding's (one step per token), if a step that
        verifies k proposals costs 1 + verify_row_cost * k plain steps."""
        cost = self.num_steps + verify_row_cost * self.num_proposed
        return cost / self.num_tokens if self.num_tokens else None


def replay_stream(
    config: SpeculativeConfig, prompt: list[int], output: list[int], max_seq_len: int = 1 << 20
) -> ReplayCounts:
    """The counts of one greedy request whose prompt and recorded output are given (its
    max_tokens = len(output), as the benchmark's ignore_eos runs)."""
    speculation = Speculation(config, max_seq_len)
    sampling = SamplingParams(max_tokens=len(output), temperature=0.0, ignore_eos=True)
    seq = Sequence(0, 0, list(prompt) + output[:1], len(prompt))  # the prefill's token
    group = SequenceGroup("replay", 0, sampling, [seq])
    counts = ReplayCounts()
    while seq.num_output_tokens < len(output):
        proposals = speculation.propose(group, seq, room=1 << 30)
        done = seq.num_output_tokens
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == output[done + accepted]:
            accepted += 1
        step_tokens = output[done : done + accepted + 1]
        seq.token_ids.extend(step_tokens)
        speculation.record(len(proposals), accepted)
        counts.num_steps += 1
        counts.num_speculating_steps += bool(proposals)
        counts.num_proposed += len(proposals)
        counts.num_accepted += accepted
        counts.num_tokens += len(step_tokens)
    return counts


def lookup_bound_stream(prompt: list[int], output: list[int], k: int) -> ReplayCounts:
    """The most any lookup in the request's own tokens could accept, K proposals a step: at
    every step the earlier occurrence of the last token whose continuation the recorded output
    follows longest, chosen in hindsight, proposing exactly what is accepted. No proposer can
    beat its tokens per step; it bounds what tuning the n-gram rule can give on these outputs."""
    tokens = list(prompt) + output[:1]
    counts = ReplayCounts()
    while (done := len(tokens) - len(prompt)) < len(output):
        room = min(k, len(output) - done - 1)
        best = 0
        for end in range(len(tokens) - 2, -1, -1):
            if best == room:
                break
            if tokens[end] != tokens[-1]:
                continue
            length = 0
            while (
                length < room
                and end + 1 + length < len(tokens)
                and tokens[end + 1 + length] == output[done + length]
            ):
                length += 1
            best = max(best, length)
        tokens.extend(output[done : done + best + 1])
        counts.num_steps += 1
        counts.num_speculating_steps += bool(best)
        counts.num_proposed += best
        counts.num_accepted += best
        counts.num_tokens += best + 1
    return counts
