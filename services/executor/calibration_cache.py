"""The embedded model's calibration maxima on disk, so that only its first int8 start pays the pass.

The fp32 calibration pass (smoothing.input_maxima) costs a few 512-token prefills; the result
depends only on the weights and the calibration tokens, so it is kept under the cache root,
keyed by both. Only the embedded model's: its converted weights live in our own cache already,
while other checkpoints (test models in temporary folders among them) would leave files behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.model_source import cache_root, is_embedded

log = logging.getLogger(__name__)
FORMAT = "smoothquant-maxima-v1"  # bump when what the maxima mean changes


def cached_maxima(
    model_dir: Path | None,
    token_ids: list[int],
    measure: Callable[[], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """measure()'s result, read from the cache when it holds this model's and these tokens'."""
    if model_dir is None or not is_embedded(model_dir):
        return measure()
    path = cache_root() / "calibration" / f"{_key(model_dir, token_ids)}.safetensors"
    if path.is_file():
        try:
            return load_file(path)
        except Exception:  # noqa: BLE001 - a torn or foreign file: measure again
            log.warning("unreadable calibration cache %s; measuring again", path)
    maxima = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    save_file({name: t.contiguous() for name, t in maxima.items()}, partial)
    os.replace(partial, path)  # atomic: a concurrent start reads a whole file or none
    return maxima


def _key(model_dir: Path, token_ids: list[int]) -> str:
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(str(model_dir.resolve()).encode())
    for file in sorted(model_dir.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()[:32]
