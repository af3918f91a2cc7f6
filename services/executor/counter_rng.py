"""Counter-based random numbers: SplitMix64 over (row key, vocabulary index), batched in torch.

A draw depends only on its key, never on a generator's history, so a seeded request samples
the same tokens whatever else is in the batch and after any preemption. One code path serves
the CPU and the GPU: plain int64 tensor ops (multiplication wraps modulo 2**64 on both).
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned `value` (what a torch tensor holds)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(value: int) -> int:
    """SplitMix64's finaliser on a Python int (unsigned 64-bit result); used for row keys."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, sample_index: int, position: int) -> int:
    """The key of one draw: which request (seed), which of its samples, which output token."""
    return position_key(sample_key(seed, sample_index), position)


def sample_key(seed: int, sample_index: int) -> int:
    """The part of row_key fixed for a whole sample: computed once, not once per draw."""
    return mix64(mix64(seed + _GOLDEN) + sample_index * _GOLDEN)


def position_key(sample: int, position: int) -> int:
    """row_key from its sample_key: one mix per draw."""
    return _signed(mix64(sample + position * _GOLDEN))


def position_keys(samples: np.ndarray, positions: list[int] | np.ndarray) -> torch.Tensor:
    """position_key over a step's rows on the host: [R] uint64 sample keys and R positions ->
    [R] int64 draw keys (CPU). numpy's uint64 arithmetic wraps as SplitMix64 needs and costs
    ~1 us per op on a few hundred rows, where a Python mix per row costs ~1 us per row."""
    z = np.asarray(positions, dtype=np.uint64) * np.uint64(_GOLDEN) + samples
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return torch.from_numpy(z.view(np.int64))


def _xorshift_(z: torch.Tensor, bits: int, scratch: torch.Tensor) -> None:
    """z ^= z >> bits (logical), in place: masking the sign copies off torch's arithmetic shift."""
    torch.bitwise_right_shift(z, bits, out=scratch)
    scratch.bitwise_and_((1 << (64 - bits)) - 1)
    z.bitwise_xor_(scratch)


def _vocab_offsets(vocab_size: int, device: torch.device) -> torch.Tensor:
    # [vocab] int64: (v + 1) * increment, the counter of element v (wraps mod 2**64).
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device)
    return index.mul_(_signed(_GOLDEN))


def uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows] int64 keys -> [num_rows, vocab_size] fp32 uniforms in the open interval (0, 1).

    Element (r, v) is SplitMix64's (v+1)-th output for seed keys[r], its top 23 bits: with the
    half-step offset that is exactly representable in fp32. Every step is in place on one
    [rows, vocab] int64 buffer and one scratch buffer: fresh multi-megabyte tensors per op
    would cost more in page faults than the arithmetic on a CPU.
    """
    return _counters_to_uniform_(_vocab_offsets(vocab_size, keys.device)[None, :] + keys[:, None])


def _counters_to_uniform_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 counters (in place), then their top 23 bits as fp32
    uniforms in (0, 1)."""
    scratch = torch.empty_like(z)
    _xorshift_(z, 30, scratch)
    z.mul_(_signed(_MIX1))
    _xorshift_(z, 27, scratch)
    z.mul_(_signed(_MIX2))
    _xorshift_(z, 31, scratch)
    torch.bitwise_right_shift(z, 41, out=scratch)
    scratch.bitwise_and_((1 << 23) - 1)
    return scratch.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


def gumbel_at(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 keys, [num_rows, C] int64 vocabulary ids -> [num_rows, C] the Gumbel
    noise gumbel(keys, vocab) holds at those ids (the same bits), without the other columns."""
    counters = (token_ids + 1).mul_(_signed(_GOLDEN)).add_(keys[:, None])
    return _counters_to_uniform_(counters).log_().neg_().log_().neg_()


def gumbel(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows] keys -> [num_rows, vocab_size] Gumbel(0, 1) noise.

    argmax(logits + gumbel) draws from softmax(logits): the same race as argmax(p / Exp(1)),
    without a softmax or torch.multinomial (which would synchronise with the host).
    """
    return uniform(keys, vocab_size).log_().neg_().log_().neg_()


def uniform_reference(key: int, vocab_index: int) -> float:
    """The same value as uniform(...)[r, vocab_index] computed with Python ints (for tests)."""
    z = mix64(((key & _MASK64) + (vocab_index + 1) * _GOLDEN) & _MASK64)
    return ((z >> 41) + 0.5) / (1 << 23)
