"""--dtype auto: float32 on a CPU, the checkpoint's saved dtype on other devices."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from services.executor.model_setup import model_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device name needs no GPU


@pytest.mark.parametrize(
    ("saved", "device", "expected"),
    [
        ("bfloat16", CPU, torch.float32),  # bf16 matmuls are slow on most CPUs
        ("bfloat16", CUDA, torch.bfloat16),
        ("float16", CUDA, torch.float16),
        ("float32", CUDA, torch.float32),
        (None, CUDA, torch.float32),
    ],
)
def test_auto_takes_the_checkpoints_dtype_off_the_cpu(saved, device, expected):
    config = LlamaConfig(dtype=saved) if saved else LlamaConfig()
    if saved is None:
        config.dtype = None
    assert model_dtype("auto", config, device) == expected


def test_a_named_dtype_wins_everywhere():
    config = LlamaConfig(dtype="bfloat16")
    assert model_dtype("float16", config, CPU) == torch.float16
    assert model_dtype("float32", config, CUDA) == torch.float32
