"""Reading checkpoint tensors one at a time: the rank's slice, converted into its parameter; a
progress bar only where stderr is a terminal."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from safetensors.torch import save_file

from services.executor.checkpoint_reader import checkpoint_names, copy_from_checkpoint


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def checkpoint(tmp_path):
    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_file({"b.weight": weight, "a.bias": torch.ones(3)}, tmp_path / "model.safetensors")
    return tmp_path, weight


def test_the_slice_is_copied_in_the_parameters_dtype(checkpoint):
    model_dir, weight = checkpoint
    dest = torch.zeros(4, 2, dtype=torch.bfloat16)
    file = model_dir / "model.safetensors"
    copy_from_checkpoint(dest, file, "b.weight", lambda t: t[:, 2:4])
    assert torch.equal(dest, weight[:, 2:4].to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"b\.weight: checkpoint shape \(4, 6\) != \(4, 2\)"):
        copy_from_checkpoint(dest, file, "b.weight")


def test_names_come_with_a_bar_on_a_terminal_only(checkpoint, monkeypatch):
    model_dir, _ = checkpoint
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    names = [name for _, name in checkpoint_names(model_dir)]
    assert names == ["a.bias", "b.weight"] and quiet.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert [name for _, name in checkpoint_names(model_dir)] == names
    assert f"loading {model_dir.name}" in terminal.getvalue()


def test_a_directory_without_safetensors_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        list(checkpoint_names(tmp_path))
