"""StepInFlight: a launched step, from launch() until its collect()."""

from __future__ import annotations

import dataclasses
import functools

import torch

from services.executor.phase_timer import PhaseTimer
from services.executor.prompt_logprobs import PromptScores
from services.executor.sampling_state import Draw, HostCopy
from shared.protocol import StepResult
from shared.sampling import SamplingParams


@dataclasses.dataclass
class SpecRows:
    """A speculating sequence's draws: draws[first_draw : first_draw + len(proposals) + 1]."""

    seq_id: int
    first_draw: int
    start_pos: int  # position of its last real token (the plan's start_pos)
    proposals: list[int]  # [K] the proposed tokens, draft slots filled in
    greedy: bool
    draft_probs: torch.Tensor | None = None  # [K, vocab] q of sampled draft proposals


@dataclasses.dataclass
class StepInFlight:
    """A launched step: its device work queued, its sampled ids perhaps still on their way."""

    step_id: int
    draws: list[Draw] = dataclasses.field(default_factory=list)
    timer: PhaseTimer | None = None
    copy: HostCopy | None = None  # the sampled ids (and logprobs) being copied to the host
    params: list[SamplingParams] | None = None  # each draw's, when some row wants logprobs
    device_tokens: torch.Tensor | None = None  # [len(draws)] int64 sampled ids on the device
    # [len(draws)] each draw's sequence, where every draw is its sequence's only one (most
    # steps): the next plan's inputs are device_tokens as they stand if it names these in order.
    draw_seq_ids: list[int] | None = None
    prompt: PromptScores | None = None  # asked-for prompt logprobs, still on the device
    result: StepResult | None = None  # once collected (at launch for a failure)
    spec: list[SpecRows] = dataclasses.field(default_factory=list)  # speculating sequences
    rng_keys: torch.Tensor | None = None  # [len(draws)] int64, kept only for draft_probs

    @functools.cached_property
    def rows(self) -> dict[int, int]:
        """seq_id -> its draw's row of device_tokens; built only when a step reads from it."""
        return {d.seq_id: i for i, d in enumerate(self.draws)}

    def landed(self) -> bool:
        """Its device work, the copy of its samples included, is done: collect() would not
        wait. (The timer's last mark is recorded after everything the step queued.)"""
        return self.result is not None or self.timer.landed()
