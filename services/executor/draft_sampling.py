"""The draft model's choice of each proposal: argmax for greedy requests, a counter-RNG draw
from its processed distribution (with that distribution returned) for sampled ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import host_to_device
from services.executor.counter_rng import gumbel, mix64, position_key
from services.executor.sampler import _top_k_top_p
from shared.sampling import SamplingParams

# Draft draws use their own counter stream: keyed like the target's draws they would be
# correlated with the uniforms that accept or reject them, and the output would be biased.
_DRAFT_STREAM = 0x5EC0D1A7F7D2A1F3


def draft_stream_key(sample_key: int) -> int:
    """The key of a sequence's draft draws (from its target sample_key)."""
    return mix64(sample_key ^ _DRAFT_STREAM)


@dataclass
class DraftRows:
    """Per-row sampling parameters of one draft step, on the logits' device."""

    greedy: list[bool]
    temperature: torch.Tensor  # [B] fp32, 1 for greedy rows (never read)
    top_k: torch.Tensor  # [B] int64, vocab when off
    top_p: torch.Tensor  # [B] fp32, inf when off
    min_p: torch.Tensor  # [B] fp32, 0 when off
    rng_keys: torch.Tensor  # [B] int64 counter-RNG keys, 0 for greedy rows
    use_top_k_top_p: bool


def draft_rows(
    params: list[SamplingParams],
    stream_keys: list[int],  # draft_stream_key of each row's sequence
    positions: list[int],  # absolute position of the token each row proposes
    vocab_size: int,
    device: torch.device,
) -> DraftRows:
    greedy = [p.greedy for p in params]
    floats = torch.tensor(
        [
            [1.0 if g else p.temperature for p, g in zip(params, greedy)],
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params],
            [p.min_p for p in params],
        ],
        dtype=torch.float32,
    )
    ints = torch.tensor(
        [
            [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
            # Keyed by position, not by a step count: a seeded request proposes the same
            # tokens at the same positions after any preemption or batch change.
            [0 if g else position_key(k, pos) for g, k, pos in zip(greedy, stream_keys, positions)],
        ],
        dtype=torch.int64,
    )
    use_top_k_top_p = any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params)
    floats, ints = host_to_device(floats, device), host_to_device(ints, device)
    return DraftRows(greedy, floats[0], ints[0], floats[1], floats[2], ints[1], use_top_k_top_p)


def choose(
    logits: torch.Tensor,  # [B, vocab] fp32, the draft model's own
    rows: DraftRows,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(proposed token [B] int64, the processed distribution [B, vocab] fp32 each sampled row
    drew from, None when every row is greedy). Temperature, min-p, top-k and top-p as the
    target's sampler applies them, so that the draft's distribution is close to the target's
    and proposals are accepted often; verification is exact whatever the draft's distribution."""
    greedy_ids = logits.argmax(dim=-1)
    if all(rows.greedy):
        return greedy_ids, None
    scaled = logits / rows.temperature[:, None]
    if bool((rows.min_p > 0).any()):
        threshold = scaled.max(dim=-1, keepdim=True).values + torch.log(rows.min_p)[:, None]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    if rows.use_top_k_top_p:  # a full sort of every row: only when some row filters
        scaled = _top_k_top_p(scaled, rows.top_k, rows.top_p)
    probs = scaled.softmax(dim=-1)  # [B, vocab]
    drawn = (scaled + gumbel(rows.rng_keys, logits.shape[-1])).argmax(dim=-1)
    greedy = host_to_device(torch.tensor(rows.greedy), logits.device)
    return torch.where(greedy, greedy_ids, drawn), probs
