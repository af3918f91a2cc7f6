"""Reading checkpoint tensors one at a time: the rank's slice, converted into its parameter; a
file reopened once its mapping has served a largest tensor's bytes; a progress bar only where
stderr is a terminal."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from safetensors.torch import save_file

from services.executor import checkpoint_reader
from services.executor.checkpoint_reader import CheckpointReader


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
    with CheckpointReader(model_dir) as reader:
        tensor = {t.name: t for t in reader}["b.weight"]
        assert tensor.nbytes == 24 * 4
        reader.copy(dest, tensor, lambda t: t[:, 2:4])
        assert torch.equal(dest, weight[:, 2:4].to(torch.bfloat16))
        with pytest.raises(ValueError, match=r"b\.weight: checkpoint shape \(4, 6\) != \(4, 2\)"):
            reader.copy(dest, tensor)


def test_a_mapping_serves_at_most_a_largest_tensors_bytes(tmp_path, monkeypatch):
    # One tensor of 256 bytes (the budget), then 32 of 32 bytes: 8 of them per mapping.
    tensors = {"big": torch.zeros(64)} | {
        f"small.{i:02d}": torch.full((8,), float(i)) for i in range(32)
    }
    save_file(tensors, tmp_path / "model.safetensors")
    opened = []
    real_open = checkpoint_reader.safe_open

    def counting_open(file, framework):
        opened.append(file)
        return real_open(file, framework=framework)

    with CheckpointReader(tmp_path) as reader:
        monkeypatch.setattr(checkpoint_reader, "safe_open", counting_open)
        for tensor in reader:
            dest = torch.empty(tensors[tensor.name].shape)
            reader.copy(dest, tensor)
            assert torch.equal(dest, tensors[tensor.name].float())
    assert len(opened) == 1 + 32 // 8


def test_names_come_with_a_bar_on_a_terminal_only(checkpoint, monkeypatch):
    model_dir, _ = checkpoint
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    names = [t.name for t in CheckpointReader(model_dir)]
    assert names == ["a.bias", "b.weight"] and quiet.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert [t.name for t in CheckpointReader(model_dir)] == names
    assert f"loading {model_dir.name}" in terminal.getvalue()


def test_a_directory_without_safetensors_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        CheckpointReader(tmp_path)
