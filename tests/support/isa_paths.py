"""The x86 instruction-set paths a row kernel's source compiles to, for tests that build each
one in its own process and compare it with the path the machine built."""

from __future__ import annotations

from pathlib import Path

# Compiler flags per path: the AVX2 one (without AVX-512) and plain C++.
PATHS = {
    "avx2": ["-O3", "-march=haswell", "-mno-avx512f", "-ffp-contract=off"],
    "portable": ["-O3", "-march=x86-64", "-ffp-contract=off"],
}


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists the flag (False where it cannot be read)."""
    try:
        return any(
            flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )  # fmt: skip
    except OSError:
        return False
