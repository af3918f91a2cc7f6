"""Prompt logprobs: the asked-for prompt rows of a step's hidden states through the LM head and
the sampler's log-softmax, in slices, and their records for the scheduler."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.executor.sampler import token_logprobs
from shared.protocol import PromptLogprobs, SampledToken, ScheduledSeq

# Rows scored at once: bounds the [rows, vocab] fp32 logits a long prompt chunk would need.
SLICE_ROWS = 256


@dataclass
class PromptSpan:
    seq_id: int
    start_pos: int  # position of the first token scored
    num_tokens: int
    k: int  # top logprobs per token


@dataclass
class PromptScores:
    """A step's prompt logprobs on the device, until collect() reads them."""

    spans: list[PromptSpan]
    target_ids: list[int]  # [P] the scored prompt tokens, span after span
    logprobs: torch.Tensor  # [P] fp32
    ranks: torch.Tensor  # [P] int64, 1: the most likely token
    top_logprobs: torch.Tensor  # [P, k_max] fp32, descending
    top_ids: torch.Tensor  # [P, k_max] int64

    def records(self) -> list[PromptLogprobs]:
        logprobs, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_values, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        out, at = [], 0
        for span in self.spans:
            tokens = []
            for i in range(at, at + span.num_tokens):
                top = list(zip(top_ids[i][: span.k], top_values[i][: span.k]))
                tokens.append(SampledToken(span.seq_id, self.target_ids[i], logprobs[i], top))
            out.append(
                PromptLogprobs(
                    span.seq_id, span.start_pos, tokens, ranks[at : at + span.num_tokens]
                )
            )
            at += span.num_tokens
        return out


def prompt_rows(
    seqs: list[ScheduledSeq], top_k: Callable[[int], int]
) -> tuple[list[int], list[int], list[PromptSpan]]:
    """(flat hidden-state rows, the prompt tokens they predict, spans) of the plan's sequences
    that asked; top_k(seq_id): top logprobs that sequence wants."""
    rows, targets, spans = [], [], []
    asked = [i for i, s in enumerate(seqs) if s.prompt_targets is not None]
    if not asked:  # nearly every step: one pass over the plan, no row bookkeeping
        return rows, targets, spans
    firsts = list(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
    for i in asked:
        seq, scored = seqs[i], seqs[i].prompt_targets
        row, count = firsts[i] + scored.first_row, len(scored.token_ids)
        rows.extend(range(row, row + count))
        targets.extend(scored.token_ids)
        start_pos = seq.start_pos + scored.first_row + 1
        spans.append(PromptSpan(seq.seq_id, start_pos, count, top_k(seq.seq_id)))
    return rows, targets, spans


def score_prompt(
    hidden: torch.Tensor,  # [T, hidden] the step's flat hidden states
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [R, hidden] -> [R, vocab]
    rows: list[int],
    targets: list[int],
    spans: list[PromptSpan],
) -> PromptScores:
    """Only the asked-for rows go through the LM head: other requests pay nothing."""
    device = hidden.device
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    target_ids = torch.tensor(targets, dtype=torch.int64, device=device)
    k_max = max(span.k for span in spans)
    parts = []
    for at in range(0, len(rows), SLICE_ROWS):
        logits = compute_logits(hidden[row_index[at : at + SLICE_ROWS]]).float()
        parts.append(token_logprobs(logits, target_ids[at : at + SLICE_ROWS], k_max, ranks=True))
    logprobs, tops, top_ids, ranks = (torch.cat(tensors) for tensors in zip(*parts))
    return PromptScores(spans, targets, logprobs, ranks, tops, top_ids)
