"""Fixtures of the service tier: a running `pagedserve serve` stack shared by the modules that
ask for it (a stack start costs several seconds of CPU: processes, imports, model load)."""

from __future__ import annotations

import pytest

from tests.service.stack_process import ServeProcess

NUM_BLOCKS = 256


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory):
    """A running stack; yields (base_url, model_name, plan_log_path). Tests leave it idle (every
    request ended, every block free) and read its counters as differences."""
    plan_log = tmp_path_factory.mktemp("stack") / "plans.jsonl"
    serve = ServeProcess(
        tiny_model_dir,
        "--num-device-blocks", str(NUM_BLOCKS), "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--plan-log", str(plan_log),
    )  # fmt: skip
    try:
        yield serve.url, serve.model, plan_log
    finally:
        assert serve.stop() == 0
