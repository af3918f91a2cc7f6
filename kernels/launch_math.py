"""Integer arithmetic for the kernels' host wrappers.

triton.next_power_of_2 and triton.cdiv are constexpr functions: callable from Python, but each
call unwraps its arguments as constexprs first (about 2 us a call on this CPU,
`benchmarks/triton_launch_overhead.py`), and a step that is not replayed from a CUDA graph
calls the attention wrappers once per layer, each making several. These give the same
results on plain ints."""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as triton.next_power_of_2 (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv."""
    return -(-a // b)
