"""lm-eval's local-completions model scores a committed multiple-choice task through the served
tiny model exactly as its transformers model scores the same items (benchmarks/lm_eval_mc.py)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from tests.service.stack_process import API_KEY

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "lm_eval_mc.py"


def test_served_multiple_choice_accuracy_equals_transformers(
    stack, tiny_model_dir, monkeypatch, tmp_path
):
    """Also the smoke run of benchmarks/lm_eval_mc.py: the script itself, its argv, its JSON."""
    url, model, _ = stack
    out = tmp_path / "lm_eval_mc.json"
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.chdir(ROOT)  # the task's data file is relative to the root
    argv = ["--base-url", url, "--model", model, "--model-dir", str(tiny_model_dir)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv, "--out", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    result = json.loads(out.read_text())
    served, reference = result["served"], result["transformers"]
    assert served["chosen"] == reference["chosen"]
    assert served["acc"] == reference["acc"]
    for got, expected in zip(served["loglikelihoods"], reference["loglikelihoods"]):
        assert got == pytest.approx(expected, abs=1e-3)
    assert len(set(served["chosen"])) > 1  # not "the first choice always wins"
