"""Where each checkpoint tensor goes in a model, and which slice of it a tensor-parallel rank
holds, worked out from the model class's declarations (packed modules, tensor-parallel plan)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from services.executor.models.spec import ModelSpec
from services.executor.tensor_parallel import Shard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# One expert's linear of a mixture of experts: experts.N.w1 is expert N of our experts.w1.
_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.([^.]+)$")


@dataclass(frozen=True)
class Placement:
    """One checkpoint tensor's place: our parameter, the rows of it the tensor fills, and the
    part of the tensor this rank keeps."""

    param: str  # our parameter name, e.g. layers.3.self_attn.qkv_proj.weight
    dest_rows: tuple[int, int] | None  # rows of our (rank-local) parameter; None: all of it
    # Rows of the checkpoint tensor this rank keeps, concatenated in order (column-parallel,
    # vocabulary-parallel); None: every row.
    source_rows: tuple[tuple[int, int], ...] | None = None
    source_columns: tuple[int, int] | None = None  # row-parallel weights: input columns
    driver_only: bool = False  # row-parallel biases: added after the sum, by rank 0 alone
    expert: int | None = None  # stacked expert weights: the expert's index along dim 0


def _unit(spec: ModelSpec, shard: Shard, unit: str) -> tuple[int, int, int]:
    """(full size, this rank's start, this rank's end) of a split unit, in rows or columns."""
    d = spec.head_dim
    if unit == "q":
        start, end = shard.span(spec.num_heads)
        return spec.num_heads * d, start * d, end * d
    if unit == "kv":
        start, end = shard.kv_span(spec.num_heads, spec.num_kv_heads)
        return spec.num_kv_heads * d, start * d, end * d
    if unit == "mlp":
        start, end = shard.span(spec.intermediate_size)
        return spec.intermediate_size, start, end
    if unit == "moe":  # one expert's MLP width
        start, end = shard.span(spec.moe.intermediate_size)
        return spec.moe.intermediate_size, start, end
    raise ValueError(f"unknown tensor-parallel unit {unit!r}")


def place(model_class, spec: ModelSpec, shard: Shard, name: str) -> Placement | None:
    """Where checkpoint tensor `name` goes; None for tensors the model does not load."""
    if any(part in name for part in model_class.ignored_checkpoint_names):
        return None
    if name == "lm_head.weight":
        return None if spec.tie_word_embeddings else _vocab(spec, shard, name)
    match = _LAYER.match(name)
    if match is None:
        if not name.startswith("model."):
            return None
        stripped = name[len("model.") :]
        if stripped.split(".")[0] in model_class.vocab_parallel:
            return _vocab(spec, shard, stripped)
        return Placement(stripped, None)
    layer, module, kind = match.groups()
    expert = _EXPERT.match(module)
    if expert is not None:  # expert N's 2-D tensor fills slice N of our stacked weight
        stacked = f"{expert.group(1)}.{expert.group(3)}"
        placement = _layer_placement(model_class, spec, shard, layer, stacked, kind)
        return dataclasses.replace(placement, expert=int(expert.group(2)))
    return _layer_placement(model_class, spec, shard, layer, module, kind)


def _layer_placement(model_class, spec, shard, layer: str, module: str, kind: str) -> Placement:
    parent, _, leaf = module.rpartition(".")
    packed, index = _packed_target(model_class, leaf)
    ours = f"{parent}.{packed}" if packed and parent else module
    plan = model_class.tensor_parallel_plan.get(ours)
    param = f"layers.{layer}.{ours}.{kind}"
    if plan is None:  # replicated: norms
        if packed:
            raise ValueError(f"{model_class.__name__}: packed {ours} has no tensor-parallel plan")
        return Placement(param, None)
    how, units = plan
    if how == "row":
        if kind == "bias":
            return Placement(param, None, driver_only=True)
        _, start, end = _unit(spec, shard, units)
        return Placement(param, None, source_columns=(start, end))
    # Column-parallel: a checkpoint tensor holds one part (index) or every part (index None).
    parts = units if index is None else (units[index],)
    source, offset = [], 0
    for unit in parts:
        full, start, end = _unit(spec, shard, unit)
        source.append((offset + start, offset + end))
        offset += full
    return Placement(param, _part_rows(spec, shard, units, index), source_rows=tuple(source))


def _packed_target(model_class, leaf: str) -> tuple[str | None, int | None]:
    for packed, members in model_class.packed_modules_mapping.items():
        if leaf in members:
            return packed, members.index(leaf)
    return None, None


def _part_rows(spec, shard, units, index) -> tuple[int, int] | None:
    """Rows of our rank-local fused parameter that part `index` fills; None: all of them."""
    if index is None or units is None:
        return None
    start = 0
    for unit in units[:index]:
        _, lo, hi = _unit(spec, shard, unit)
        start += hi - lo
    _, lo, hi = _unit(spec, shard, units[index])
    return start, start + hi - lo


def _vocab(spec: ModelSpec, shard: Shard, param: str) -> Placement:
    start, end = shard.span(spec.vocab_size)
    rows = None if shard.size == 1 else ((start, end),)
    return Placement(param, None, source_rows=rows)


def rank_slice(placement: Placement, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The part of a checkpoint tensor this rank holds, as `placement` says."""
    if shard.size == 1:
        return tensor
    if placement.driver_only:
        return tensor if shard.is_driver else torch.zeros_like(tensor)
    if placement.source_columns is not None:
        start, end = placement.source_columns
        return tensor[:, start:end]
    if placement.source_rows is not None:
        pieces = [tensor[start:end] for start, end in placement.source_rows]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return tensor
