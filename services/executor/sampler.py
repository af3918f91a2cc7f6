"""Token sampling: greedy, temperature, top-k, top-p, per-sequence seeded generators, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import SampledToken
from shared.sampling import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, sample index) pairs over the 64-bit seed space


def sequence_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """The private generator of the index-th parallel sample of a seeded request."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed((params.seed + index * _GOLDEN) % 2**64)


@dataclass
class SampleRow:
    """One token to draw: which logits row, for which sequence, under which parameters."""

    logits_row: int
    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None  # None: the executor's shared generator


def sample(
    logits: torch.Tensor,  # [num_logit_rows, vocab] fp32
    rows: list[SampleRow],
    shared_generator: torch.Generator,
) -> list[SampledToken]:
    """Draw one token per row. Several rows may read the same logits (n > 1 forks)."""
    row_ids = [r.logits_row for r in rows]
    if row_ids != list(range(logits.shape[0])):  # forks read a row twice: expand (copies)
        logits = logits.index_select(0, torch.tensor(row_ids, dtype=torch.int64))
    # logits: [num_rows, vocab]
    tokens = torch.empty(len(rows), dtype=torch.int64)

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == len(rows):
        tokens = logits.argmax(dim=-1)
    elif greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random:
        probs = _filtered_probs(logits[random], [rows[i].params for i in random])
        shared = [j for j, i in enumerate(random) if rows[i].generator is None]
        if shared:
            drawn = torch.multinomial(probs[shared], 1, generator=shared_generator)
            tokens[[random[j] for j in shared]] = drawn.squeeze(1)
        for j, i in enumerate(random):
            if rows[i].generator is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]

    token_list = tokens.tolist()
    out = [SampledToken(r.seq_id, t) for r, t in zip(rows, token_list)]
    wants = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if wants:
        # Logprobs of the model's own distribution (before temperature and filtering).
        logprobs = torch.log_softmax(logits[wants], dim=-1)
        chosen = logprobs.gather(1, tokens[wants].unsqueeze(1)).squeeze(1).tolist()
        max_k = max(rows[i].params.logprobs for i in wants)
        top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
        for j, i in enumerate(wants):
            out[i].logprob = chosen[j]
            k = rows[i].params.logprobs
            if k:
                out[i].top_logprobs = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
    return out


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k and top-p applied per row."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    # top_p == 1 keeps everything; an infinite threshold avoids dropping the tail by rounding.
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        sorted_logits.masked_fill_(rank >= torch.tensor(top_k)[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_before > torch.tensor(top_p)[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)
