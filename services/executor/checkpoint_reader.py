"""Read safetensors checkpoints one tensor at a time, memory-mapped, straight into parameters."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_names(model_dir: Path) -> Iterator[tuple[Path, str]]:
    """(file, tensor name) of every tensor in the checkpoint, with a progress bar on a terminal."""
    names = []
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt") as f:
            names += [(file, name) for name in f.keys()]
    from tqdm.auto import tqdm

    # Only where someone watches: a captured stderr (tests, logs) gets no bar.
    bar = tqdm(
        names, desc=f"loading {Path(model_dir).name}", unit="tensor",
        disable=not sys.stderr.isatty(), leave=False,
    )  # fmt: skip
    yield from bar


def copy_from_checkpoint(
    dest: torch.Tensor,
    file: Path,
    name: str,
    part: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
) -> None:
    """Copy `part` of checkpoint tensor `name` into `dest`, converting to dest's dtype on dest's
    device.

    The file is opened for this one tensor: safetensors maps the whole file, and the pages a
    read touched count in the process's resident memory until the mapping is closed, so one
    open file per checkpoint would make host memory grow to the file's size. Here it peaks at
    one tensor. `part` takes the rank's slice of the mapped tensor (a view), so only the slice
    is copied.
    """
    with safe_open(file, framework="pt") as f:
        source = part(f.get_tensor(name))  # a view of the mapped file: nothing read yet
        if source.shape != dest.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(source.shape)} != {tuple(dest.shape)}"
            )
        if source.device != dest.device:
            # Moved in the checkpoint's dtype and converted there: a conversion on the way
            # would make a host copy in the target dtype.
            source = source.to(dest.device)
        dest.copy_(source)
