"""Score soft-capping for the Triton attention kernels: cap * tanh(s / cap), as Gemma 2 needs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap_scores(s, cap):
    """cap * tanh(s / cap) elementwise; tanh from exp, which every Triton build (and the
    interpreter) has: tanh(x) = 1 - 2 / (exp(2x) + 1), saturating cleanly at +-1."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap)) + 1.0))
