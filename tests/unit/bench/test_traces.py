"""Synthetic traces hit the paper's mean lengths, respect vLLM's bounds and are seeded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.bench.traces import (
    ALPACA,
    SHAREGPT,
    load_sharegpt,
    shared_prefix_trace,
    synthetic_trace,
    trace_stats,
)


@pytest.mark.parametrize(
    ("model", "prompt_mean", "output_mean"), [(SHAREGPT, 161, 338), (ALPACA, 19, 58)]
)
def test_synthetic_means_and_bounds(model, prompt_mean, output_mean):
    trace = synthetic_trace(model, 5000, rate=2.0, seed=0, vocab_size=1000)
    stats = trace_stats(trace)
    assert stats["mean_prompt_len"] == pytest.approx(prompt_mean, rel=0.04)
    assert stats["mean_output_len"] == pytest.approx(output_mean, rel=0.04)
    assert all(r.prompt_len >= 4 and r.output_len >= 4 for r in trace)
    assert stats["max_prompt_len"] <= 1024 and stats["max_total_len"] <= 2048
    assert all(3 <= t < 1000 for r in trace[:50] for t in r.prompt_token_ids)
    # Heavy tail: the longest prompt is several times the mean.
    assert stats["max_prompt_len"] > 4 * stats["mean_prompt_len"]
    # Poisson arrivals: mean gap 1/rate, exponential (coefficient of variation ~1).
    gaps = np.diff([0.0] + [r.arrival_s for r in trace])
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)


def test_traces_are_seeded():
    a = synthetic_trace("sharegpt", 20, 1.0, seed=3, vocab_size=500)
    assert a == synthetic_trace("sharegpt", 20, 1.0, seed=3, vocab_size=500)
    assert a != synthetic_trace("sharegpt", 20, 1.0, seed=4, vocab_size=500)
    assert {r.arrival_s for r in synthetic_trace("alpaca", 5, float("inf"), 0, 500)} == {0.0}


@pytest.mark.parametrize(("shots", "prefix_len"), [(1, 80), (5, 341)])
def test_shared_prefix_trace(shots, prefix_len):
    trace = shared_prefix_trace(shots, 300, 1.0, seed=0, vocab_size=1000)
    prefix = trace[0].prompt_token_ids[:prefix_len]
    assert all(r.prompt_token_ids[:prefix_len] == prefix for r in trace)
    suffix_mean = np.mean([r.prompt_len - prefix_len for r in trace])
    assert suffix_mean == pytest.approx(30, rel=0.1)


class _WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_sharegpt_loader_keeps_first_two_turns_within_bounds(tmp_path):
    def conv(prompt_words: int, answer_words: int) -> dict:
        return {
            "conversations": [
                {"from": "human", "value": " ".join(["ab"] * prompt_words)},
                {"from": "gpt", "value": " ".join(["c"] * answer_words)},
                {"from": "human", "value": "ignored"},
            ]
        }

    data = [conv(10, 20), conv(3, 20), conv(1100, 5), conv(1000, 1100), conv(50, 4), {"x": 1}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    trace = load_sharegpt(path, _WordTokenizer(), num_requests=10, rate=1.0, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in trace) == [(10, 20), (50, 4)]
    assert all(r.prompt_token_ids == (2,) * r.prompt_len for r in trace)
