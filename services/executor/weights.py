"""Load a local Hugging Face checkpoint (config.json + safetensors) into its registry model."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

import torch

from kernels.ops import KernelOps
from services.executor.checkpoint_reader import CheckpointReader
from services.executor.models import model_class
from services.executor.models.checkpoint_names import Placement, place, rank_slice
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.spec import ModelSpec
from services.executor.tensor_parallel import Shard, check_divisible


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    max_positions: int,
    ops: KernelOps,
    device: torch.device | str = "cpu",
    shard: Shard | None = None,
) -> DecoderForCausalLM:
    """The model, or with `shard` this rank's slice of it (see tensor_parallel.py)."""
    shard = shard or Shard()
    config = load_hf_config(model_dir)
    family, architecture = model_class(config)
    spec = family.spec_from_config(config, architecture)
    check_divisible(spec, shard.size)
    cos, sin = family.rope_tables(config, max_positions)
    with torch.device("meta"):
        model = family(spec, cos, sin, ops, shard)
    # Allocated once, on the device and in the target dtype: no host copy of the whole model.
    model = model.to(dtype).to_empty(device=device)
    model.cos.copy_(cos)  # RoPE tables stay fp32, as transformers computes them
    model.sin.copy_(sin)
    _copy_weights(model, spec, model_dir, shard)
    return model.eval()


def _copy_weights(
    model: DecoderForCausalLM, spec: ModelSpec, model_dir: Path, shard: Shard
) -> None:
    params = dict(model.named_parameters())
    filled: Counter[str] = Counter()  # elements written per parameter, to catch missing tensors
    with CheckpointReader(model_dir) as reader:
        for tensor in reader:
            placement = _target(model, tensor.name)
            if placement is None:
                continue
            target, rows = placement.param, placement.dest_rows
            if target not in params:
                raise KeyError(
                    f"checkpoint tensor {tensor.name} has no place in the model ({target})"
                )
            dest = params[target].data
            if placement.expert is not None:  # one expert's slice of a stacked weight
                dest = dest[placement.expert]
            if rows is not None:
                dest = dest[rows[0] : rows[1]]
            # Sliced for this rank before anything is read or copied.
            reader.copy(dest, tensor, partial(_rank_slice, placement, shard=shard))
            filled[target] += dest.numel()
    missing = sorted(p for p, t in params.items() if filled[p] != t.numel())
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} lacks tensors for {missing[:3]} ({len(missing)})"
        )


def _rank_slice(placement: Placement, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The part of a checkpoint tensor that this rank holds (the model's tensor-parallel plan)."""
    return rank_slice(placement, tensor, shard)


def _target(model: DecoderForCausalLM, name: str) -> Placement | None:
    """Where checkpoint tensor `name` goes (the model's packed-module declarations); None for
    tensors the model does not load."""
    return place(type(model), model.spec, model.shard, name)
