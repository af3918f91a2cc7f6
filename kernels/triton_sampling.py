"""Gumbel-max sampling in one Triton pass per row: the GPU path of the sampler's plain draw.

services/executor/sampler.py draws argmax(logits / T + gumbel(key)) with the noise of
services/executor/counter_rng.py (SplitMix64 over (row key, vocabulary index)). In torch that
is about a dozen passes over [rows, vocab] int64 and fp32 buffers; here each program walks its
row once in tiles, makes the same noise in registers and keeps a running argmax, so the
[rows, vocab] noise never exists in memory. Same integer hash, same float steps (divide, then
-log(-log(u)), then add), so its tokens are the torch path's (tests/triton/
test_triton_sampling.py, under the interpreter). Rows with top-k, top-p or min-p keep the torch
path, which masks the logits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.executor.counter_rng import _GOLDEN, _MIX1, _MIX2

_BLOCK = 1024  # vocabulary entries per tile


@triton.jit(do_not_specialize=["vocab", "stride_row"])
def _gumbel_argmax_kernel(
    logits_ptr,  # [rows, vocab] fp32
    temperature_ptr,  # [rows] fp32, > 0
    keys_ptr,  # [rows] int64 row keys (counter_rng.position_key)
    out_ptr,  # [rows] int64 drawn token ids
    vocab,  # int
    stride_row,  # int: logits' row stride
    golden,  # uint64 SplitMix64 constants (passed as arguments: literals this wide do not
    mix1,  # fit Triton's int64 constants)
    mix2,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    temperature = tl.load(temperature_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf"))
        # Element v's counter is (v + 1) * golden + key (mod 2**64): counter_rng.uniform.
        z = (offs + 1).to(tl.uint64) * golden + key
        z = (z ^ (z >> 30)) * mix1
        z = (z ^ (z >> 27)) * mix2
        z = z ^ (z >> 31)
        u = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # top 23 bits, in (0, 1)
        score = x / temperature + -tl.log(-tl.log(u))
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
) -> torch.Tensor:  # [rows] int64
    """argmax(logits / temperature + gumbel(keys)) per row, as sampler._draw computes it."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _gumbel_argmax_kernel[(rows,)](
        logits,
        temperature.contiguous(),
        keys.contiguous(),
        out,
        vocab,
        logits.stride(0),
        _GOLDEN,
        _MIX1,
        _MIX2,
        BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)),
    )
    return out
