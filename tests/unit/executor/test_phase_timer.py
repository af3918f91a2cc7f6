"""Per-phase step timings: every phase named, in order, adding up to the step."""

from __future__ import annotations

import time

import pytest
import torch

from services.executor.phase_timer import PhaseTimer


def _timed_phases(device: torch.device) -> tuple[dict[str, float], float]:
    start = time.perf_counter()
    timer = PhaseTimer(device)
    x = torch.randn(256, 256, device=device)
    for _ in range(20):
        x = x @ x.T / 256
    timer.mark("compute")
    time.sleep(0.05)
    timer.mark("wait")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return timer.seconds(), time.perf_counter() - start


def test_cpu_phases_follow_the_host_clock():
    phases, wall = _timed_phases(torch.device("cpu"))
    assert list(phases) == ["compute", "wait"]
    assert phases["wait"] >= 0.045 and 0 < sum(phases.values()) <= wall


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_phases_follow_the_device_clock():
    phases, wall = _timed_phases(torch.device("cuda"))
    assert list(phases) == ["compute", "wait"]
    assert 0 < sum(phases.values()) <= wall + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_timer_is_read_after_waiting_for_its_last_mark_only():
    # A step's timings are read in collect() with later steps still queued: waiting for the
    # last mark must make every event readable without a device-wide synchronisation.
    timer = PhaseTimer(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(50):
        x = x @ x.T / 2048
    timer.mark("compute")
    later = x
    for _ in range(50):  # the next step, queued behind
        later = later @ later.T / 2048
    timer.wait()
    assert timer.landed()
    assert timer.seconds()["compute"] > 0


def test_a_cpu_timer_has_always_landed():
    timer = PhaseTimer(torch.device("cpu"))
    timer.mark("compute")
    assert timer.landed()
    timer.wait()  # returns at once
    assert set(timer.seconds()) == {"compute"}
