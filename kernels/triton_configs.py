"""Per-GPU launch options (num_warps, num_stages) for the attention kernels.

`benchmarks/triton_config_sweep.py` times each kernel over a grid of options on the GPU it
runs on and writes the fastest to kernels/configs/<device name>.json. A GPU without such a
file gets Triton's own defaults (4 warps, 3 stages on NVIDIA), so nothing changes until a
sweep has measured something better. Launches on a CPU (the interpreter) take no options.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"
KERNELS = ("decode", "prefill")
# Triton's defaults for NVIDIA GPUs: what a launch gets without options.
DEFAULT = {"num_warps": 4, "num_stages": 3}


def config_path(device_name: str) -> Path:
    """kernels/configs/<device name, lower case, runs of other characters as one '-'>.json"""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return CONFIGS / f"{slug}.json"


@functools.cache
def _configs(device_name: str) -> dict[str, dict[str, int]]:
    path = config_path(device_name)
    saved = json.loads(path.read_text())["kernels"] if path.exists() else {}
    return {kernel: {**DEFAULT, **saved.get(kernel, {})} for kernel in KERNELS}


# kernel -> options the sweep is timing, ahead of any file (benchmarks/triton_config_sweep.py)
trying: dict[str, dict[str, int]] = {}


def launch_options(kernel: str, device: torch.device) -> dict[str, int]:
    """num_warps and num_stages for `kernel` on `device` (and the decode kernel's tile_tokens
    where a sweep chose one); {} off a GPU."""
    if device.type != "cuda":
        return {}
    if kernel in trying:
        return dict(trying[kernel])
    return dict(_configs(torch.cuda.get_device_name(device))[kernel])
