"""Ray is optional: serving without --ray-address never imports it."""

from __future__ import annotations

import subprocess
import sys

# Everything `pagedserve serve` loads on its way to start the processes, and each process's main.
PLAIN_PATH = """
import sys
from services.cli import main
import services.launcher, services.gateway.service, services.scheduler.service
import services.executor.service, services.executor.tp_worker
try:
    main(["serve", "--help"])
except SystemExit:
    pass
assert "ray" not in sys.modules, "ray was imported"
"""


def test_serving_without_a_ray_address_imports_no_ray():
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_PATH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--ray-address" in done.stdout  # the flag is there, Ray is not loaded for it
