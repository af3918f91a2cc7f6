"""benchmarks/attention_kernels.py's measurements run on the CPU, under the interpreter, with
its GPU timer and graph capture stood in for: a GPU session should not be the first to run
its Python (the script exits on a machine without CUDA)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton

import triton.testing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "attention_kernels", ROOT / "benchmarks" / "attention_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ran = []

    def do_bench(fn):  # each timed call runs once; its "time" names how many ran before it
        fn()
        ran.append(fn)
        return float(len(ran))

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(module, "graphed", lambda run: run)
    return module, ran


def test_a_decode_cell_times_each_split_count_and_the_automatic_one(script):
    module, ran = script
    # 2 sequences of 40 tokens in 16-token blocks: a table of 3 blocks, so 8 splits is left out.
    row = module.measure(2, 40, 4, 2, 16, 16, torch.float32, torch.device("cpu"), 1.0, [1, 2, 8])
    assert row["auto_splits"] in (1, 2, 3)
    assert set(row["graphed_us_by_splits"]) == {"1", "2", str(row["auto_splits"])}
    # do_bench's stand-in returns growing times: the first split count timed is the fastest.
    assert row["best_splits"] == 1
    assert row["max_abs_diff_vs_sdpa"] < 1e-5  # the kernel's attention is SDPA's
    assert len(ran) == 4 + len(row["graphed_us_by_splits"])


def test_a_prefill_cell_runs(script):
    module, ran = script
    row = module.measure_prefill(
        2, 20, 4, 2, 16, 16, torch.float32, torch.device("cpu"), triton.testing.do_bench
    )
    assert row["batch"] == 2 and row["prompt_len"] == 20 and len(ran) == 2
