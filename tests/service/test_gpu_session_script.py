"""benchmarks/gpu_session.sh, checked on the CPU: a lent GPU's minutes are not spent finding a
renamed flag, a missing package or a stage that cannot fit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_dry_run_parses_every_stage_and_collects_the_gpu_tests(tmp_path):
    stages = ("tests", "kernels", "1b", "1b-quick", "syncs", "profile", "profile-8b", "1b-varied",
              "8b", "sweep", "sampling")  # fmt: skip
    done = _dry_run(tmp_path, STAGES=" ".join(stages))
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    for stage in stages:
        assert f"== {stage}: exit 0" in log, log
    assert log.count("parsed: benchmarks/") == 10
    assert "test_triton_decode.py: " in log  # collected, not run


def test_the_dry_run_stops_before_any_stage_when_an_import_fails(tmp_path):
    fake = tmp_path / "shadow" / "gguf"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no gguf on this machine')\n")
    done = _dry_run(tmp_path, PYTHONPATH=str(fake.parent))
    assert done.returncode == 1
    log = (tmp_path / "out" / "session.log").read_text()
    assert "no gguf on this machine" in log and "== tests" not in log


def test_a_flag_the_script_does_not_know_fails_the_parse(tmp_path):
    argv = [sys.executable, "-m", "scripts.parse_only", "benchmarks/attention_kernels.py"]
    good = subprocess.run([*argv, "--dtype", "bfloat16"], cwd=ROOT, capture_output=True)
    bad = subprocess.run([*argv, "--no-such-flag"], cwd=ROOT, capture_output=True, text=True)
    assert good.returncode == 0
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr


def test_each_stage_fits_five_minutes_and_the_default_set_twelve():
    text = SCRIPT.read_text()
    limits = dict(re.findall(r"^\s+stage ([\w-]+) (\d+) ", text, re.M))
    default_set = re.search(r'^STAGES=\$\{STAGES:-"([^"]+)"\}', text, re.M).group(1).split()
    assert set(default_set) < set(limits)  # every default stage exists; sweep is extra
    assert max(int(v) for v in limits.values()) <= 300
    assert sum(int(limits[name]) for name in default_set) < 12 * 60
