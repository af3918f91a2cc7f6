"""The Locust harness end to end: loadtest/run.sh against a tiny model, no failures, reports."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None, reason="locust is not installed"
)


def test_a_short_headless_run_has_no_failures_and_writes_reports(tiny_model_dir, tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PORT": "0",  # the server binds a free port and run.sh reads it from the ready line
        "LOADTEST_LENGTH_SCALE": "0.1",  # ShareGPT's shape at a tenth of its lengths
        "LOADTEST_MAX_PROMPT_TOKENS": "100",
        "LOADTEST_MAX_OUTPUT_TOKENS": "64",
        "LOADTEST_SEED": "0",
    }
    argv = [str(ROOT / "loadtest" / "run.sh"), "-u", "4", "-t", "15s", "-o", str(tmp_path),
            "--", "--model", str(tiny_model_dir), "--num-device-blocks", "256"]  # fmt: skip
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    with open(tmp_path / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert rows[("", "Aggregated")]["Failure Count"] == "0"
    for name in ("chat", "completion"):
        assert int(rows[("POST", name)]["Request Count"]) > 0
        assert int(rows[("TTFT", name)]["Request Count"]) > 0
        assert int(rows[("TPOT", name)]["Request Count"]) > 0
        assert float(rows[("TTFT", name)]["Average Response Time"]) > 0
    assert (tmp_path / "report.html").stat().st_size > 0
    assert "pagedserve: ready" in (tmp_path / "serve.log").read_text()
