"""The row kernels' int8 linear (kernels/csrc/int8_rows.cpp): its integer arithmetic exactly, on
every instruction-set path, each row independent of the others, and where Int8Linear uses it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_rows
from services.executor import quantized
from services.executor.quantized import (
    INT8_ROWS_MAX_ROWS,
    Int8Linear,
    exact_decode_kernel,
    pack_int8_rows,
)
from tests.support.int8_rows_reference import check_op, random_case
from tests.support.isa_paths import PATHS, cpu_has

OPS = cpu_rows.load_row_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"not built: {cpu_rows.build_error()}")
SOURCE = Path(cpu_rows.__file__).parent / "csrc" / "int8_rows.cpp"


@needs_ops
def test_the_built_path_is_the_integer_reference_and_row_independent():
    check_op(OPS.int8_rows_linear)


# Each path the source compiles to on this CPU family (tests/support/isa_paths.py): the build
# above takes the best one the machine has; these build the others in a fresh process (one
# library per process: each defines the same op).


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_instruction_set_path_computes_the_same_integers(path, tmp_path):
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None:
        pytest.skip("the paths are x86's; needs a C++ compiler")
    if path == "avx2" and not cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    script = f"""
import torch
from torch.utils.cpp_extension import load
load(name="int8_rows_{path}", sources=[{str(SOURCE)!r}], extra_cflags={PATHS[path]!r},
     is_python_module=False, build_directory={str(tmp_path)!r})
from tests.support.int8_rows_reference import check_op
check_op(torch.ops.pagedserve_cpu.int8_rows_linear)
print("checked")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


@needs_ops
def test_int8_linear_takes_it_for_few_rows_only(monkeypatch):
    """Where _int_mm is fast (AVX-512 VNNI): calls beyond INT8_ROWS_MAX_ROWS stay on it."""
    monkeypatch.setattr(quantized, "int_mm_has_fast_path", lambda: True)
    gen = torch.Generator().manual_seed(0)
    layer = Int8Linear(torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen))
    plain = Int8Linear(layer.qweight_t.t().float() * layer.scales[:, None], layer.bias)
    layer.use_row_ops(OPS)
    assert layer.rows_packed is not None
    assert layer.few_rows is None  # fbgemm's copy released: no call would take it
    for rows in (1, INT8_ROWS_MAX_ROWS):
        x = torch.randn(rows, 24, generator=gen)
        direct = OPS.int8_rows_linear(x, layer.rows_packed, layer.rows_colsum, layer.scales)
        assert torch.equal(layer(x), direct + layer.bias)
    # A decode step's one row and the same row among a verify step's: the same bits (fbgemm's
    # one-row and guarded several-row calls quantize them differently).
    x = torch.randn(4, 24, generator=gen)
    assert torch.equal(layer(x[:1]), layer(x)[:1])
    x = torch.randn(INT8_ROWS_MAX_ROWS + 1, 24, generator=gen)
    assert torch.equal(layer(x), plain(x))  # beyond: the layer's other kernels, unchanged
    layer.use_row_ops(None)
    assert layer.rows_packed is None
    assert (layer.few_rows is not None) == exact_decode_kernel()  # fbgemm's back where it sums


@needs_ops
def test_without_a_fast_int_mm_it_takes_calls_of_every_size(monkeypatch):
    """Elsewhere torch._int_mm is a plain loop (a 128-token prompt chunk of the embedded model
    took 9.5 s on an AVX2-only CPU): prompt chunks take the row kernels too, and never _int_mm;
    each row's result is still its one-row call's."""
    monkeypatch.setattr(quantized, "int_mm_has_fast_path", lambda: False)
    gen = torch.Generator().manual_seed(1)
    layer = Int8Linear(torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen))
    layer.use_row_ops(OPS)

    def no_int_mm(*args):
        raise AssertionError("_int_mm called")

    monkeypatch.setattr(torch, "_int_mm", no_int_mm)
    x = torch.randn(3 * INT8_ROWS_MAX_ROWS + 5, 24, generator=gen)
    out = layer(x)
    direct = OPS.int8_rows_linear(x, layer.rows_packed, layer.rows_colsum, layer.scales)
    assert torch.equal(out, direct + layer.bias)
    assert torch.equal(out, torch.cat([layer(row) for row in x.split(1)]))
    # Without the row kernels (not built, or turned off) the call has no other int8 path.
    layer.use_row_ops(None)
    with pytest.raises(AssertionError, match="_int_mm called"):
        layer(x)


@needs_ops
def test_one_row_is_fbgemms_one_row_call_bit_for_bit():
    """The same activation levels as fbgemm's dynamic linear takes for one row (its range, zero
    point and fused rounding), so the row kernels change no one-row decode's numerics."""
    from services.executor.quantized import exact_decode_kernel, linear_dynamic, pack_for_fbgemm

    if not exact_decode_kernel():
        pytest.skip("fbgemm does not sum exactly on this CPU (no VNNI): nothing to compare")
    for seed in range(6):
        x, levels, scales = random_case(3, 96, 160, seed)
        x = x + seed * 0.3  # rows of one sign, of both, and the all-zero row shifted
        packed, colsum = pack_int8_rows(levels)
        fbgemm = pack_for_fbgemm(levels, scales, None)
        for row in x.split(1):
            expected = linear_dynamic(row, fbgemm, False)
            assert torch.equal(OPS.int8_rows_linear(row, packed, colsum, scales), expected)


@needs_ops
def test_no_decode_kernel_means_none_of_it():
    """--int8-decode-kernel int_mm keeps every call on _int_mm, the row kernels' too."""
    layer = Int8Linear(torch.randn(16, 8), None, decode_kernel=False)
    layer.use_row_ops(OPS)
    assert layer.rows_packed is None
