"""Launch options per GPU: Triton's defaults until a sweep file says better, none on a CPU."""

from __future__ import annotations

import json

import torch

from kernels import triton_configs


def test_a_cpu_launch_takes_no_options():
    assert triton_configs.launch_options("decode", torch.device("cpu")) == {}


def test_a_gpu_reads_its_sweep_file_and_falls_back_to_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_configs, "CONFIGS", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    triton_configs._configs.cache_clear()
    cuda = torch.device("cuda")
    try:
        assert triton_configs.launch_options("decode", cuda) == triton_configs.DEFAULT
        assert triton_configs.config_path("NVIDIA H200") == tmp_path / "nvidia-h200.json"
        (tmp_path / "nvidia-h200.json").write_text(
            json.dumps({"device": "NVIDIA H200", "kernels": {"prefill": {"num_warps": 8}}})
        )
        triton_configs._configs.cache_clear()
        assert triton_configs.launch_options("prefill", cuda) == {"num_warps": 8, "num_stages": 3}
        assert triton_configs.launch_options("decode", cuda) == triton_configs.DEFAULT
        triton_configs.trying["decode"] = {"num_warps": 2, "num_stages": 1}
        assert triton_configs.launch_options("decode", cuda) == {"num_warps": 2, "num_stages": 1}
    finally:
        triton_configs.trying.clear()
        triton_configs._configs.cache_clear()
