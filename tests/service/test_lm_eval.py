"""lm-eval's local-completions model scores a committed multiple-choice task through the served
tiny model exactly as its transformers model scores the same items (benchmarks/lm_eval_mc.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lm_eval_mc import compare
from tests.service.stack_process import API_KEY

pytest.importorskip("lm_eval")


def test_served_multiple_choice_accuracy_equals_transformers(stack, tiny_model_dir, monkeypatch):
    url, model, _ = stack
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.chdir(Path(__file__).parents[2])  # the task's data file is relative to the root
    result = compare(url, model, str(tiny_model_dir))
    served, reference = result["served"], result["transformers"]
    assert served["chosen"] == reference["chosen"]
    assert served["acc"] == reference["acc"]
    for got, expected in zip(served["loglikelihoods"], reference["loglikelihoods"]):
        assert got == pytest.approx(expected, abs=1e-3)
    assert len(set(served["chosen"])) > 1  # not "the first choice always wins"
