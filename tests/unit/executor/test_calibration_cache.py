"""The embedded model's calibration maxima are measured once and read back after; other models'
are measured every time and leave no file."""

from __future__ import annotations

import torch

from services.executor import calibration_cache


def counting_measure(calls: list[int]):
    def measure() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"layers.0.mlp.down_proj": torch.tensor([1.5, 2.0]), "lm_head": torch.ones(3)}

    return measure


def test_embedded_maxima_are_measured_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration_cache, "is_embedded", lambda model_dir: True)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"weights")
    calls: list[int] = []
    first = calibration_cache.cached_maxima(model_dir, [5, 6, 7], counting_measure(calls))
    again = calibration_cache.cached_maxima(model_dir, [5, 6, 7], counting_measure(calls))
    assert calls == [1]
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    # Other calibration tokens are another entry.
    calibration_cache.cached_maxima(model_dir, [5, 6], counting_measure(calls))
    assert calls == [1, 1]


def test_other_models_are_measured_every_time_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    calls: list[int] = []
    for _ in range(2):
        calibration_cache.cached_maxima(tmp_path, [1, 2], counting_measure(calls))
    assert calls == [1, 1]
    assert not (tmp_path / "cache").exists()
