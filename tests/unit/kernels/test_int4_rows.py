"""The row kernels' 4-bit linear (kernels/csrc/int4_rows.cpp): its arithmetic (the torch
reference up to fp32 rounding, the worst case without saturation), each row independent of the
others, the same bits on every instruction-set path, and where Int4Linear uses it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_rows
from services.executor.quantized import Int4Linear
from tests.support.int4_rows_reference import check_op, outputs
from tests.support.isa_paths import PATHS, cpu_has

OPS = cpu_rows.load_row_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"not built: {cpu_rows.build_error()}")
SOURCE = Path(cpu_rows.__file__).parent / "csrc" / "int4_rows.cpp"


@needs_ops
def test_the_built_path_is_the_reference_and_row_independent():
    check_op(OPS.int4_rows_linear)


@needs_ops
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_instruction_set_path_gives_the_same_bits(path, tmp_path):
    """The AVX2 path and the plain C++ one (built in a fresh process each: one library per
    process defines the op) give the built path's outputs bit for bit: the integer sums are
    exact and the float steps are the same fused multiply-adds in the same order."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None:
        pytest.skip("the paths are x86's; needs a C++ compiler")
    if path == "avx2" and not (cpu_has("avx2") and cpu_has("f16c") and cpu_has("fma")):
        pytest.skip("this CPU has no AVX2 with F16C and FMA")
    torch.save(outputs(OPS.int4_rows_linear), tmp_path / "built.pt")
    script = f"""
import torch
from torch.utils.cpp_extension import load
load(name="int4_rows_{path}", sources=[{str(SOURCE)!r}], extra_cflags={PATHS[path]!r},
     is_python_module=False, build_directory={str(tmp_path)!r})
from tests.support.int4_rows_reference import check_op, outputs
from tests.support.isa_paths import PATHS, cpu_has
op = torch.ops.pagedserve_cpu.int4_rows_linear
check_op(op)
built = torch.load({str(tmp_path / "built.pt")!r})
assert all(torch.equal(a, b) for a, b in zip(outputs(op), built, strict=True))
print("checked")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


@needs_ops
def test_int4_linear_takes_it_for_every_call_and_keeps_torchs_kernel_without_it():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=gen) * 0.05, torch.randn(48, generator=gen)
    layer = Int4Linear.from_float(weight, bias)
    x = torch.randn(40, 64, generator=gen)
    torchs = layer(x)  # torch's int4 kernel: the layer's weights in fp32
    assert layer.packed_bytes > 0  # its layout, made for that call
    layer.use_row_ops(OPS)
    # One copy of the weights left: 0.625 bytes each (4 bits, fp16 d and m per 32).
    assert layer.packed_bytes == 0 and layer.rows_packed.numel() == 48 * 64 * 5 // 8
    rows = layer(x)
    assert torch.equal(rows, OPS.int4_rows_linear(x, layer.rows_packed) + bias)
    assert torch.equal(rows[:1], layer(x[:1]))  # a decode row's bits, alone or among others
    # The same weights; only the activations' 8-bit levels per 32 inputs differ.
    assert (rows - torchs).abs().max() < 0.02 * torchs.abs().max()
    layer.use_row_ops(None)
    assert torch.equal(layer(x), torchs)
