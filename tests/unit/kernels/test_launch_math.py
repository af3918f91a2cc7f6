"""The wrappers' integer helpers give triton's own results."""

from __future__ import annotations

import triton

from kernels.launch_math import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(2**40 + 1) == 2**41


def test_cdiv_matches_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 256):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
