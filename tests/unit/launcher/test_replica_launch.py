"""Each replica gets its own rendezvous port and, on a GPU machine, its own devices."""

from __future__ import annotations

from dataclasses import replace

from services.launcher import _replica_engine
from shared.config import EngineConfig, ModelConfig, ParallelConfig


def _config(master_port: int | None = None, device: str = "auto") -> EngineConfig:
    parallel = ParallelConfig(tensor_parallel_size=2, master_port=master_port)
    return EngineConfig(model=ModelConfig(device=device), parallel=parallel)


def test_replicas_get_their_own_port_and_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = _config(master_port=29500)
    own, env = _replica_engine(config, 1, 2)
    assert own == replace(config, parallel=replace(config.parallel, master_port=29501))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert _replica_engine(config, 0, 1) == (config, None)  # one replica: unchanged
    assert _replica_engine(_config(device="cpu"), 1, 2)[1] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7,8")  # the operator decides
    assert _replica_engine(_config(device="cuda"), 1, 2)[1] is None
