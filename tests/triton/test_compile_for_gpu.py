"""Every Triton kernel compiles for an H200's target (sm_90) on this CPU, each variant the
GPU path launches: Triton's interpreter, which the other CPU tests use, accepts code its
compiler rejects, and a lent GPU's minutes should not be spent finding that out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kernels_defined() -> set[str]:
    """The names of the launched @triton.jit functions under kernels/ (helpers called from
    inside a kernel are compiled with it and are not listed)."""
    names = set()
    for path in (ROOT / "kernels").glob("triton_*.py"):
        source = path.read_text()
        names |= set(re.findall(r"@triton\.jit[^\n]*\ndef (_\w+_kernel)\(", source))
    return names


# An H100/H200 and an A100 (Ampere's dots hold their accumulators in registers: the first to
# spill when a tile is too tall).
@pytest.mark.parametrize("capability", [90, 80])
def test_every_kernel_variant_compiles_without_spills(tmp_path, capability):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    report = tmp_path / "resources.json"
    done = subprocess.run(
        [sys.executable, "-m", "scripts.compile_for_gpu", "--capability", str(capability),
         "--json", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    compiled = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("_")}
    expected = _kernels_defined()
    assert len(expected) >= 7  # the scan found the kernels
    assert compiled == expected  # each kernel, none left out
    # Both sampler variants, split-K and not, a softcap and a window among the variants.
    out = done.stdout
    assert "'FILTERS': True" in out and "'FILTERS': False" in out
    assert "'SPLIT': True" in out and "'SOFTCAP': True" in out and "'WINDOW': True" in out
    # No variant spills: a stack frame in these kernels is registers spilled to local memory
    # (the prefill kernel's short-query tiles, when they multiplied and reduced in registers
    # instead of padding to a dot, took all 255 registers or up to 5,824 stack bytes per
    # thread at sm_90; its 64-row tiles at head_dim 256 spilled 104-136 bytes at sm_80).
    # A few variants keep an 8-byte frame: 16 bytes are allowed.
    variants = json.loads(report.read_text())["variants"]
    assert len(variants) == len([line for line in out.splitlines() if line.startswith("_")])
    spilling = [v for v in variants if v["stack_bytes"] > 16]
    assert not spilling, spilling
    assert all(0 < v["registers"] <= 255 for v in variants)
    # Every prefill variant of these head layouts (head_dim >= 16) runs its tiles as dots.
    prefill = [v["constexprs"] for v in variants if v["kernel"] == "_prefill_kernel"]
    assert prefill and all(options["USE_DOT"] for options in prefill)
