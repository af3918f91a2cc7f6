"""Batched token sampling on the logits' device: one pass over [rows, vocab] for the whole step.

Order (as vLLM's v1 sampler): logit bias, min_tokens masks and grammar masks; penalties; then
greedy rows take the argmax, random rows are temperature-scaled, min-p, top-k and top-p
filtered and drawn by a Gumbel race with counter-based noise keyed by (seed, sample, position).
Logprobs are the model's own log-softmax (before any of this), only for rows that asked.
Nothing here synchronises with the host: the executor copies the results out once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor.counter_rng import gumbel, gumbel_at


@dataclass
class PenaltyInputs:
    rows: torch.Tensor  # [P] int64 rows of the batch that carry penalties
    output_counts: torch.Tensor  # [P, vocab] int32 occurrences in the generated tokens
    prompt_mask: torch.Tensor  # [P, vocab] bool tokens present in the prompt
    presence: torch.Tensor  # [P] fp32
    frequency: torch.Tensor  # [P] fp32
    repetition: torch.Tensor  # [P] fp32


@dataclass
class SamplingBatch:
    """Per-row parameters of one step's draws, already on the logits' device."""

    logits_rows: torch.Tensor  # [B] int64 logits row each draw reads (n > 1 forks share a row)
    rows_identity: bool  # logits_rows is 0..B-1: the draws read the logits as they are
    temperature: torch.Tensor  # [B] fp32, 0 for greedy rows
    top_k: torch.Tensor  # [B] int64, vocab when off
    max_top_k: int  # largest top_k among rows that use it (a host value: no sync to find it)
    # [B] fp32; inf when off, so cumulative-sum rounding above 1 never drops a tail token
    top_p: torch.Tensor
    min_p: torch.Tensor  # [B] fp32, 0 when off
    rng_keys: torch.Tensor  # [B] int64 counter-RNG keys (see counter_rng.row_key)
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    num_logprobs: int  # top logprobs to return per row (max over rows that asked), -1: none
    penalties: PenaltyInputs | None = None
    # logit_bias: logits[bias_rows] += bias; [L] int64 rows, [L, vocab] fp32 (zero where unset).
    bias_rows: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    # Additive edits applied as logits[rows, tokens] += values (-inf masks for min_tokens):
    # [E] int64, [E] int64, [E] fp32.
    edit_rows: torch.Tensor | None = None
    edit_tokens: torch.Tensor | None = None
    edit_values: torch.Tensor | None = None
    # Structured output: [B, ceil(vocab / 32)] int32 allowed-token bitmask (bit set = allowed)
    # for the rows in grammar_rows ([G] int64); other rows are unconstrained.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None
    # Speculative decoding with draft probabilities: keep the logits each row raced over.
    want_filtered: bool = False
    # Every row that draws keeps only some tokens (top_k < vocab or top_p < 1): the draws may
    # race over each row's best candidates instead of the whole vocabulary (see _draw).
    every_row_filtered: bool = False


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] fp32 logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [B, k] int64
    top_logprobs: torch.Tensor | None = None  # [B, k] fp32
    # [B, vocab] fp32 the logits each row's draw raced over (after every filter and the
    # temperature; a greedy row's processed logits), only when batch.want_filtered.
    filtered: torch.Tensor | None = None


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [R, vocab] fp32 (one row per sampling sequence) -> one token per draw row.

    The logits are consumed: bias, masks and penalties may be applied to them in place.
    """
    vocab = logits.shape[-1]
    # [B, vocab]: the logits rows themselves when no row is read twice (no fork this step).
    raw = logits if batch.rows_identity else logits.index_select(0, batch.logits_rows)
    edits = (
        batch.bias is not None
        or batch.edit_rows is not None
        or batch.grammar_bitmask is not None
        or batch.penalties is not None
    )
    # Edits happen in place; keep the model's own logits intact when logprobs are read later.
    processed = _processed_logits(raw.clone() if edits and batch.num_logprobs >= 0 else raw, batch)
    filtered = None
    if batch.all_greedy:
        token_ids = processed.argmax(dim=-1)
        filtered = processed if batch.want_filtered else None
    else:
        token_ids, filtered = _draw(processed, batch, vocab)
    out = SamplerOutput(token_ids, filtered=filtered)
    if batch.num_logprobs >= 0:
        out.logprobs, top_logprobs, top_ids, _ = token_logprobs(raw, token_ids, batch.num_logprobs)
        if batch.num_logprobs > 0:
            out.top_logprobs, out.top_ids = top_logprobs, top_ids
    return out


def token_logprobs(
    logits: torch.Tensor,  # [R, vocab] fp32, the model's own
    token_ids: torch.Tensor,  # [R] int64
    k: int,
    ranks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logprob of each row's token [R], top-k logprobs [R, k] and ids [R, k], the token's
    rank [R] (1: the most likely) if asked): sampled tokens and prompt tokens alike."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, vocab]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1 if ranks else None
    return chosen, top_logprobs, top_ids, rank


def _processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, vocab] logits after bias, masks and penalties (in place where possible)."""
    if batch.bias is not None:
        logits.index_add_(0, batch.bias_rows, batch.bias)
    if batch.edit_rows is not None:
        logits.index_put_((batch.edit_rows, batch.edit_tokens), batch.edit_values, accumulate=True)
    if batch.grammar_bitmask is not None:
        apply_bitmask(logits, batch.grammar_bitmask, batch.grammar_rows)
    if batch.penalties is not None:
        p = batch.penalties
        rows = logits.index_select(0, p.rows)  # [P, vocab]
        counts = p.output_counts.to(rows.dtype)
        seen = p.prompt_mask | (p.output_counts > 0)
        rep = p.repetition[:, None]
        # transformers' definition: shrink a seen token's logit towards "less likely" either way.
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        rows = rows - p.frequency[:, None] * counts
        rows = rows - p.presence[:, None] * (p.output_counts > 0).to(rows.dtype)
        logits.index_copy_(0, p.rows, rows)
    return logits


def apply_bitmask(
    logits: torch.Tensor,  # [B, vocab] fp32, edited in place
    bitmask: torch.Tensor,  # [B, ceil(vocab / 32)] int32, bit (t % 32) of word t // 32
    rows: list[int] | None,
) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf (xgrammar's kernel)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows
    )


def _draw(
    logits: torch.Tensor, batch: SamplingBatch, vocab: int, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B] drawn ids, and the [B, vocab] logits they raced over when batch.want_filtered.
    fused: the Triton kernel draws (None: on a GPU; tests ask for it under the interpreter)."""
    processed = logits
    greedy_rows = batch.temperature == 0
    greedy_ids = logits.argmax(dim=-1)
    # Greedy rows divide by 1: their draw is discarded below, and nothing becomes inf or nan.
    temperature = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
    if (logits.is_cuda if fused is None else fused) and not batch.want_filtered:
        # One fused program per row (kernels/triton_sampling.py): the same tokens as below,
        # without the [B, vocab] noise and scaled-logits buffers, and without sorting the
        # vocabulary for top-p (its filters search each row's thresholds instead).
        from kernels.triton_sampling import gumbel_argmax

        # The batch's per-row filters already say "off" in the kernel's terms (top_k = vocab,
        # top_p = inf, min_p = 0): passed as they are, none is made again per step.
        filters = batch.use_min_p or batch.use_top_p or batch.use_top_k
        drawn = gumbel_argmax(
            logits,
            temperature,
            batch.rng_keys,
            *((batch.top_k, batch.top_p, batch.min_p) if filters else ()),
        )
        return torch.where(greedy_rows, greedy_ids, drawn), None
    logits = logits / temperature[:, None]
    if batch.use_min_p:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed.
        threshold = logits.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    counts = _candidate_counts(batch, vocab)
    # On a CPU only: the fallback below asks the host which rows need it.
    if counts and batch.every_row_filtered and not batch.want_filtered and not logits.is_cuda:
        drawn = _draw_from_candidates(logits, batch, vocab, counts)
        return torch.where(greedy_rows, greedy_ids, drawn), None
    if batch.use_top_p:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
    elif batch.use_top_k:
        # k-th largest value per row as a threshold: a topk, not a full sort.
        values = logits.topk(batch.max_top_k, dim=-1).values  # [B, max_top_k] descending
        kth = values.gather(1, (batch.top_k.clamp(max=batch.max_top_k) - 1)[:, None])
        kth = kth.masked_fill((batch.top_k >= vocab)[:, None], float("-inf"))  # rows without
        logits = logits.masked_fill(logits < kth, float("-inf"))
    drawn = (logits + gumbel(batch.rng_keys, vocab)).argmax(dim=-1)
    filtered = None
    if batch.want_filtered:
        filtered = torch.where(greedy_rows[:, None], processed, logits)
    return torch.where(greedy_rows, greedy_ids, drawn), filtered


# Candidates per row for top-k/top-p draws: a top-k of the first count (or the batch's largest
# top_k) instead of sorting the vocabulary, which on a CPU costs several times more (49,152
# tokens: benchmarks/sampling_candidates.py); rows whose nucleus reaches past them try the
# next count, then the sort.
CANDIDATE_TIERS = (256, 4096)
# A tier is tried only while it is at most this fraction of the vocabulary: a top-k of a
# large share of the row costs about as much as the sort it would save (a 384-token vocabulary
# sorts as fast as it takes its top 256).
CANDIDATE_SHARE = 1 / 8


def _candidate_counts(batch: SamplingBatch, vocab: int) -> list[int]:
    """The tiers this batch may try: each at least its largest top_k, none over the share."""
    max_k = batch.max_top_k if batch.use_top_k else 0
    counts = [max(count, max_k) for count in CANDIDATE_TIERS]
    return [count for count in counts if count <= vocab * CANDIDATE_SHARE]


def _draw_from_candidates(
    logits: torch.Tensor,  # [B, vocab] fp32, temperature-scaled, min-p applied
    batch: SamplingBatch,
    vocab: int,
    counts: list[int],  # _candidate_counts: the tiers, smallest first
) -> torch.Tensor:  # [B] int64 drawn ids (greedy rows' are discarded by the caller)
    """The draw of _top_k_top_p and the Gumbel race, from each row's best candidates alone.

    A row with top_k keeps at most top_k tokens, all among its candidates. A row with top_p
    alone keeps the tokens whose preceding mass (under its whole softmax) is at most top_p: if
    its candidates' mass exceeds top_p, every token past them is dropped, so the candidates
    decide the draw; otherwise (a flat distribution) the row tries more candidates, and at
    last the sort of its whole vocabulary. The noise at a candidate is the noise that token
    gets in the full race (gumbel_at), so the draws are the same tokens.
    """
    drawn = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    rows = (batch.temperature > 0).nonzero()[:, 0]  # greedy rows never draw
    for count in counts:
        if not rows.numel():
            break
        keys, top_k, top_p = batch.rng_keys[rows], batch.top_k[rows], batch.top_p[rows]
        part = logits[rows]
        values, ids = part.topk(count, dim=-1)  # [R, count], descending
        rank = torch.arange(count, device=logits.device)[None, :]
        values.masked_fill_(rank >= top_k[:, None], float("-inf"))
        has_k = top_k < vocab
        # Each row's softmax: over its top-k (all candidates) or over the whole vocabulary.
        lse = torch.where(has_k, values.logsumexp(dim=-1), part.logsumexp(dim=-1))
        probs = (values - lse[:, None]).exp_()
        mass = probs.cumsum(dim=-1)
        values.masked_fill_(mass - probs > top_p[:, None], float("-inf"))
        best = (values + gumbel_at(keys, ids)).argmax(dim=-1, keepdim=True)
        decided = has_k | (mass[:, -1] > top_p)  # the host reads this: a CPU path
        drawn[rows[decided]] = ids.gather(1, best).squeeze(1)[decided]
        rows = rows[~decided]
    if rows.numel():  # nuclei past every tier: the sort of the whole vocabulary
        full = _top_k_top_p(logits[rows], batch.top_k[rows], batch.top_p[rows])
        drawn[rows] = (full + gumbel(batch.rng_keys[rows], vocab)).argmax(dim=-1)
    return drawn


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's top-k tokens and its nucleus of mass top_p; one sort."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits.masked_fill_(rank >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p; the top token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits.masked_fill_(mass_before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
