"""The embedded SmolLM2-135M-Instruct, end to end through `pagedserve generate`."""

from __future__ import annotations

import json

import pytest

from services.cli import main as cli_main


@pytest.mark.slow
def test_embedded_model_knows_the_capital_of_france(tmp_path):
    src = tmp_path / "in.jsonl"
    question = {"role": "user", "content": "What is the capital of France?"}
    src.write_text(json.dumps({"messages": [question]}) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(src), "--output", str(dst), "--max-tokens", "32"]
    assert cli_main(argv + ["--kv-cache-gb", "0.1", "--swap-space-gb", "0.1"]) == 0
    [row] = [json.loads(line) for line in dst.read_text().splitlines()]
    assert "Paris" in row["text"]
    assert row["finish_reason"] == "stop"
