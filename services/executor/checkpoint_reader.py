"""Read safetensors checkpoints one tensor at a time, memory-mapped, straight into parameters."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# Bytes per element of safetensors' dtype names.
_ELEMENT_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


@dataclass(frozen=True)
class CheckpointTensor:
    file: Path
    name: str
    nbytes: int


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _tensors(file: Path) -> list[CheckpointTensor]:
    with safe_open(file, framework="pt") as f:
        found = []
        for name in f.keys():
            view = f.get_slice(name)  # its header entry only: nothing is read
            numel = torch.Size(view.get_shape()).numel()
            found.append(CheckpointTensor(file, name, numel * _ELEMENT_BYTES[view.get_dtype()]))
        return found


class CheckpointReader:
    """The tensors of a checkpoint, each copied into its parameter as it is read.

    safetensors maps a whole file, and the pages a read touches count in the process's
    resident memory until the file is closed: one open file per checkpoint would make host
    memory grow to the file's size. A file is therefore reopened whenever the bytes read
    through its current mapping would pass the checkpoint's largest tensor, so reading holds
    at most about one largest tensor; a checkpoint of many small tensors (mixture-of-experts)
    is still not reopened per tensor, each opening parsing the file's whole header.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.tensors = [t for file in safetensors_files(model_dir) for t in _tensors(file)]
        self.budget = max((t.nbytes for t in self.tensors), default=0)
        self._handle: Any = None
        self._file: Path | None = None
        self._mapped = 0  # bytes read through the open mapping

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[CheckpointTensor]:
        """Every tensor, with a progress bar where someone watches (stderr is a terminal)."""
        from tqdm.auto import tqdm

        yield from tqdm(
            self.tensors, desc=f"loading {self.model_dir.name}", unit="tensor",
            disable=not sys.stderr.isatty(), leave=False,
        )  # fmt: skip

    def copy(
        self,
        dest: torch.Tensor,
        tensor: CheckpointTensor,
        part: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
    ) -> None:
        """Copy `part` of `tensor` into `dest`, converted to dest's dtype on dest's device.
        `part` takes the rank's slice of the mapped tensor (a view): only the slice is read."""
        source = part(self._mapping(tensor).get_tensor(tensor.name))
        if source.shape != dest.shape:
            raise ValueError(
                f"{tensor.name}: checkpoint shape {tuple(source.shape)} != {tuple(dest.shape)}"
            )
        if source.device != dest.device:
            # Moved in the checkpoint's dtype and converted there: a conversion on the way
            # would make a host copy in the target dtype.
            source = source.to(dest.device)
        dest.copy_(source)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)  # unmaps the file
        self._handle, self._file, self._mapped = None, None, 0

    def _mapping(self, tensor: CheckpointTensor) -> Any:
        if tensor.file != self._file or self._mapped + tensor.nbytes > self.budget:
            self.close()
            self._handle = safe_open(tensor.file, framework="pt").__enter__()
            self._file = tensor.file
        self._mapped += tensor.nbytes
        return self._handle
