"""Gumbel-max sampling in one Triton program per row: the GPU path of the sampler's draws.

services/executor/sampler.py draws argmax(logits / T + gumbel(key)) with the noise of
services/executor/counter_rng.py (SplitMix64 over (row key, vocabulary index)), after min-p,
top-k and top-p masks. In torch that is a sort of the whole vocabulary per row (top-p) and
about a dozen passes over [rows, vocab] int64 and fp32 buffers (the noise); here each program
walks its row in tiles, makes the same noise in registers and keeps a running argmax, so
neither the sort nor the [rows, vocab] noise exists in memory. Same integer hash, same float
steps (divide, then -log(-log(u)), then add), so its tokens are the torch path's
(tests/triton/test_triton_sampling.py, under the interpreter).

The filters without a sort: a row's kept set is every token at or above a threshold value, so
each filter is a search for its threshold over the floats' order (an int key per float, equal
floats equal keys). Each search pass reads the row once and tests SEARCH_WAYS thresholds
spread over the interval still open, narrowing it ~17-fold, so a 32-bit key is found in at
most 8 passes:
- min-p: max(logits / T) + log(min_p), as the torch path computes it (log(min_p) comes in);
- top-k: the k-th largest surviving value (the largest key with at least k tokens at or above);
- top-p: over the softmax of the tokens top-k and min-p keep, token i stays when the mass of
  the tokens above it is at most top_p, i.e. its key is at least the smallest key t whose mass
  above is at most top_p.
Ties: a sort keeps exactly k (or the nucleus) in its own order; a threshold keeps every token
equal to the boundary token (as the torch top-k-only path does). The masses are summed in
another order than the sort's cumulative sum, so a token whose preceding mass is within fp32
rounding of top_p may fall on the other side. Neither occurs in the tests' random logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_math import next_power_of_2
from services.executor.counter_rng import _GOLDEN, _MIX1, _MIX2

_BLOCK = 1024  # vocabulary entries per tile of the plain draw
_SEARCH_BLOCK = 256  # per tile of the filtered draw: each entry meets SEARCH_WAYS thresholds
_SEARCH_WAYS = 16
# Read inside the kernel: module constants a compiled kernel may use must be constexpr.
_KEY_MIN = tl.constexpr(-(2**31))  # at or below every float's key
# A search's passes: 8 narrow any key interval to one key; the cap only matters for a row
# whose values are not numbers (NaN logits), which must still end its program.
_MAX_PASSES = 10


@triton.jit
def _order_key(x):
    """fp32 -> int64 with the floats' order (-0.0 and 0.0 one key): the sign-magnitude bits of
    a negative float flipped, so that they compare as two's-complement ints."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _ways(lo, hi, WAYS: tl.constexpr):
    """[WAYS] int64 thresholds spread over (lo, hi), the largest above lo whenever hi > lo + 1."""
    j = (tl.arange(0, WAYS) + 1).to(tl.int64)
    return lo + ((hi - lo) * j) // (WAYS + 1)


@triton.jit
def _scaled_tile(base, start, vocab, temperature, BLOCK: tl.constexpr):
    """Entries [start, start + BLOCK) of a row as logits / T (-inf past the vocabulary), and
    which of them are in it."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < vocab
    return tl.load(base + offs, mask=mask, other=float("-inf")) / temperature, mask


@triton.jit(do_not_specialize=["vocab", "stride_row"])
def _gumbel_argmax_kernel(
    logits_ptr,  # [rows, vocab] fp32
    temperature_ptr,  # [rows] fp32, > 0
    keys_ptr,  # [rows] int64 row keys (counter_rng.position_key)
    out_ptr,  # [rows] int64 drawn token ids
    top_k_ptr,  # [rows] int64, >= vocab when off (FILTERS only)
    top_p_ptr,  # [rows] fp32, >= 1 (inf) when off (FILTERS only)
    log_min_p_ptr,  # [rows] fp32 log(min_p), -inf when off (FILTERS only)
    vocab,  # int
    stride_row,  # int: logits' row stride
    golden,  # uint64 SplitMix64 constants (passed as arguments: literals this wide do not
    mix1,  # fit Triton's int64 constants)
    mix2,
    FILTERS: tl.constexpr,  # min-p, top-k and top-p read; False: every token races
    BLOCK: tl.constexpr,
    WAYS: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    temperature = tl.load(temperature_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    floor = tl.full([], float("-inf"), tl.float32)  # min-p: tokens below it are masked
    k_key = tl.full([], _KEY_MIN, tl.int64)  # top-k: keys below it are masked
    p_key = tl.full([], _KEY_MIN, tl.int64)  # top-p: keys below it are masked
    if FILTERS:
        # The row's largest scaled logit: min-p's base and the softmax's shift.
        top = tl.full([], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            x, _ = _scaled_tile(base, start, vocab, temperature, BLOCK)
            top = tl.maximum(top, tl.max(x, axis=0))
        floor = top + tl.load(log_min_p_ptr + row)
        # top-k: count(key >= lo) >= k > count(key >= hi); masked tokens count as -inf, as
        # the torch path's masked logits do. Off: hi = lo + 1, no pass.
        k = tl.load(top_k_ptr + row)
        lo = tl.full([], _KEY_MIN, tl.int64)
        hi = tl.where(k < vocab, _order_key(top) + 1, lo + 1)
        passes = 0
        while (hi - lo > 1) & (passes < MAX_PASSES):
            passes += 1
            ways = _ways(lo, hi, WAYS)
            count = tl.zeros([WAYS], tl.int64)
            for start in range(0, vocab, BLOCK):
                x, mask = _scaled_tile(base, start, vocab, temperature, BLOCK)
                x = tl.where(x < floor, float("-inf"), x)
                at_or_above = (_order_key(x)[:, None] >= ways[None, :]) & mask[:, None]
                count += tl.sum(at_or_above.to(tl.int64), axis=0)
            lo = tl.maximum(lo, tl.max(tl.where(count >= k, ways, lo), axis=0))
            hi = tl.minimum(hi, tl.min(tl.where(count < k, ways, hi), axis=0))
        k_key = lo
        # top-p over the softmax of what min-p and top-k keep: mass(key > lo) > top_p >=
        # mass(key > hi); the smallest such hi is the threshold. lo starts below every kept
        # key (the whole mass), hi at the top (no mass). Off: hi = lo + 1.
        top_p = tl.load(top_p_ptr + row)
        total = tl.zeros([], tl.float32)
        lo = k_key - 1
        hi = tl.where(top_p < 1.0, _order_key(top), lo + 1)
        if top_p < 1.0:
            for start in range(0, vocab, BLOCK):
                x, _ = _scaled_tile(base, start, vocab, temperature, BLOCK)
                kept = (x >= floor) & (_order_key(x) >= k_key)
                total += tl.sum(tl.where(kept, tl.exp(x - top), 0.0), axis=0)
        passes = 0
        while (hi - lo > 1) & (passes < MAX_PASSES):
            passes += 1
            ways = _ways(lo, hi, WAYS)
            mass = tl.zeros([WAYS], tl.float32)
            for start in range(0, vocab, BLOCK):
                x, _ = _scaled_tile(base, start, vocab, temperature, BLOCK)
                x_key = _order_key(x)
                prob = tl.where((x >= floor) & (x_key >= k_key), tl.exp(x - top) / total, 0.0)
                above = x_key[:, None] > ways[None, :]
                mass += tl.sum(tl.where(above, prob[:, None], 0.0), axis=0)
            # Every way moves one bound (a NaN mass moves hi), so each pass narrows.
            above_p = mass > top_p
            lo = tl.maximum(lo, tl.max(tl.where(above_p, ways, lo), axis=0))
            hi = tl.minimum(hi, tl.min(tl.where(above_p, hi, ways), axis=0))
        p_key = tl.where(top_p < 1.0, hi, _KEY_MIN)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        scaled, mask = _scaled_tile(base, start, vocab, temperature, BLOCK)
        offs = start + tl.arange(0, BLOCK)
        # Element v's counter is (v + 1) * golden + key (mod 2**64): counter_rng.uniform.
        z = (offs + 1).to(tl.uint64) * golden + key
        z = (z ^ (z >> 30)) * mix1
        z = (z ^ (z >> 27)) * mix2
        z = z ^ (z >> 31)
        u = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # top 23 bits, in (0, 1)
        score = scaled + -tl.log(-tl.log(u))
        if FILTERS:
            x_key = _order_key(scaled)
            mask = mask & (scaled >= floor) & (x_key >= k_key) & (x_key >= p_key)
        score = tl.where(mask, score, float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_index = tl.argmax(score, axis=0).to(tl.int64) + start
        # Strictly greater: on a tie the earlier index stays, as torch.argmax keeps the first.
        better = tile_best > best
        best_index = tl.where(better, tile_index, best_index)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_index)


def gumbel_argmax(
    logits: torch.Tensor,  # [rows, vocab] fp32
    temperature: torch.Tensor,  # [rows] fp32, > 0
    keys: torch.Tensor,  # [rows] int64
    top_k: torch.Tensor | None = None,  # [rows] int64, >= vocab when off
    top_p: torch.Tensor | None = None,  # [rows] fp32, >= 1 (inf) when off
    min_p: torch.Tensor | None = None,  # [rows] fp32, 0 when off
) -> torch.Tensor:  # [rows] int64
    """argmax(logits / temperature + gumbel(keys)) per row over the tokens min-p, top-k and
    top-p keep (sampler._draw's filters), each None when no row uses it."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    filters = top_k is not None or top_p is not None or min_p is not None
    if filters:
        if top_k is None:
            top_k = torch.full((rows,), vocab, dtype=torch.int64, device=logits.device)
        if top_p is None:
            top_p = torch.full((rows,), float("inf"), device=logits.device)
        # torch's log, as the torch path's min-p threshold uses: the same float.
        if min_p is None:
            log_min_p = torch.full((rows,), float("-inf"), device=logits.device)
        else:
            log_min_p = torch.log(min_p)
        block = min(_SEARCH_BLOCK, next_power_of_2(vocab))
    else:
        top_k = top_p = log_min_p = out  # not read
        block = min(_BLOCK, next_power_of_2(vocab))
    _gumbel_argmax_kernel[(rows,)](
        logits,
        temperature.contiguous(),
        keys.contiguous(),
        out,
        top_k.contiguous(),
        top_p.contiguous(),
        log_min_p.contiguous(),
        vocab,
        logits.stride(0),
        _GOLDEN,
        _MIX1,
        _MIX2,
        FILTERS=filters,
        BLOCK=block,
        WAYS=_SEARCH_WAYS,
        MAX_PASSES=_MAX_PASSES,
    )
    return out


def warm_up_sampling(vocab: int, device: torch.device) -> list[bool]:
    """Compile both variants of the kernel (plain, filtered) for this vocabulary now, not in
    the middle of a served step: one row each. Returns the FILTERS values run."""
    logits = torch.zeros(1, vocab, device=device)
    ones = torch.ones(1, device=device)
    keys = torch.zeros(1, dtype=torch.int64, device=device)
    gumbel_argmax(logits, ones, keys)
    top_k = torch.ones(1, dtype=torch.int64, device=device)
    gumbel_argmax(logits, ones, keys, top_k=top_k, top_p=ones * 0.5, min_p=ones * 0.1)
    return [False, True]
