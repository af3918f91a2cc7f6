"""Latency summaries, the sustainable-rate rule, and the bench commands end to end (simulated)."""

from __future__ import annotations

import json

import pytest

from services.bench.latency import max_sustainable_rate, summarize
from services.bench.replay import RequestRecord
from services.cli import main


def test_summarize_hand_built_records():
    records = [
        RequestRecord(0.0, 10, 4, first_token_s=1.0, finish_s=2.5),  # e2e 2.5, tpot 0.5
        RequestRecord(1.0, 10, 2, first_token_s=1.5, finish_s=2.0),  # e2e 1.0, tpot 0.5
        RequestRecord(2.0, 10, 0),  # never finished: left out
    ]
    s = summarize(records, duration_s=2.0)
    assert s["num_finished"] == 2
    assert s["normalized_latency_s"] == pytest.approx((2.5 / 4 + 1.0 / 2) / 2)
    assert s["mean_ttft_s"] == pytest.approx(0.75)
    assert s["mean_tpot_s"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["request_throughput"] == pytest.approx(1.0)


def test_max_sustainable_rate_interpolates_the_crossing():
    assert max_sustainable_rate([1, 2, 3], [0.05, 0.08, 0.2], 0.1) == pytest.approx(2 + 1 / 6)
    assert max_sustainable_rate([3, 1, 2], [0.09, 0.05, 0.08], 0.1) == 3
    assert max_sustainable_rate([1, 2], [0.3, 0.5], 0.1) == 0.0


def test_bench_memory_and_serve_commands(tmp_path, capsys):
    # A small pool and quarter-length requests keep it fast; memory still binds.
    sim = ["--executor", "sim", "--num-device-blocks", "64", "--max-model-len", "512",
           "--length-scale", "0.25", "--num-requests", "40", "--no-progress"]  # fmt: skip
    policies = ["--kv-policy", "paged", "--kv-policy", "orca-max"]
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", *sim, *policies, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"paged", "orca-max"}
    for fractions in (*data["policies"].values(), *data["whole_run"].values()):
        assert set(fractions) == {
            "token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free"
        }  # fmt: skip
        assert all(0.0 <= v <= 1.0 for v in fractions.values())
        assert sum(fractions.values()) == pytest.approx(1.0)
    assert data["policies"]["paged"]["token_states"] > data["policies"]["orca-max"]["token_states"]
    assert data["setup"]["num_device_blocks"] == 64
    assert data["trace"]["mean_output_len"] < 120  # scaled down from ~338

    out = tmp_path / "serve.json"
    png = tmp_path / "serve.png"
    argv = ["bench", "serve", *sim, *policies, "--rates", "0.5,8", "--json", str(out)]
    assert main([*argv, "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert [p["rate"] for p in data["curves"]["paged"]] == [0.5, 8.0]
    assert data["max_sustainable_rate"]["paged"] >= data["max_sustainable_rate"]["orca-max"]
    assert png.stat().st_size > 0
    assert "max sustainable rate" in capsys.readouterr().out


def test_bench_sharing_prefix_caching_section(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sharing.json"
    argv = ["bench", "sharing", "--model", str(tiny_model_dir), "--device", "cpu",
            "--num-threads", "1", "--num-device-blocks", "128", "--max-num-batched-tokens", "64",
            "--num-requests", "6", "--system-prompt-len", "40",
            "--workload", "system-prompt", "--workload", "translation-1shot",
            "--section", "prefix_caching", "--no-progress", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert "memory_saving" not in data
    workloads = data["prefix_caching"]["workloads"]
    assert set(workloads) == {"system-prompt", "translation-1shot"}
    for name, prefix_len in (("system-prompt", 40), ("translation-1shot", 80)):
        w = workloads[name]
        assert w["prefix_len"] == prefix_len
        assert w["outputs_identical"]
        assert w["without"]["hit_tokens"] == 0 and w["without"]["queried_tokens"] == 0
        # All six arrive at once; a 64-token budget admits one or two per step, so requests
        # admitted after the first step find the prefix its step wrote.
        assert 0 < w["with"]["hit_rate"] < 1
        assert w["with"]["prompt_tokens"] == w["without"]["prompt_tokens"]
        assert w["with"]["output_tokens"] == w["without"]["output_tokens"]
    assert "speedup" in capsys.readouterr().out


def test_bench_sharing_memory_saving_section(tiny_model_dir, tmp_path):
    out = tmp_path / "saving.json"
    argv = ["bench", "sharing", "--model", str(tiny_model_dir), "--device", "cpu",
            "--num-threads", "1", "--num-device-blocks", "256", "--section", "memory_saving",
            "--widths", "2", "--saving-traces", "alpaca", "--saving-requests", "alpaca=2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert "prefix_caching" not in data
    runs = data["memory_saving"]["runs"]
    assert [(r["mode"], r["width"]) for r in runs] == [("parallel", 2), ("beam", 2)]
    assert all(0 < r["saving"] < 1 for r in runs)
