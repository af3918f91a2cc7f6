"""Each replica gets its own rendezvous port and, on a GPU machine, its own devices."""

from __future__ import annotations

import argparse

from services.launcher import _replica_engine


def _args(**kw) -> argparse.Namespace:
    values = dict(tp_master_port=None, device="auto", tensor_parallel_size=2) | kw
    return argparse.Namespace(**values)


def test_replicas_get_their_own_port_and_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    engine = ["--device", "auto", "--tp-master-port", "29500"]
    own, env = _replica_engine(_args(tp_master_port=29500), engine, 1, 2)
    assert own == ["--device", "auto", "--tp-master-port", "29501"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert _replica_engine(_args(), engine, 0, 1) == (engine, None)  # one replica: unchanged
    assert _replica_engine(_args(device="cpu"), ["--device", "cpu"], 1, 2)[1] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7,8")  # the operator decides
    assert _replica_engine(_args(), ["--device", "cuda"], 1, 2)[1] is None
