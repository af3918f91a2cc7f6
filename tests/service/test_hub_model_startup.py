"""`pagedserve serve` with a Hub id missing from the offline cache fails at startup with one
line naming the id, before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_refuses_a_hub_id_missing_offline(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--model", "org/absent", "--port", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("pagedserve: error: model 'org/absent' is not in the Hugging")
    assert str(tmp_path / "hub") in done.stderr and "Traceback" not in done.stderr
    assert "ready" not in done.stdout
