"""A draft model cut from its target: some of its decoder layers with its embedding, final norm
and LM head, saved as a checkpoint of the same family and tokenizer (layer-skip
self-speculation: no second model to train or download)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")
# Everything of a checkpoint directory but its weights and config: tokenizer, chat template,
# generation defaults.
_COPIED = ("*.json", "*.jinja", "*.txt", "*.model")


def make_layer_skip_draft(target_dir: Path, out_dir: Path, layers: list[int]) -> Path:
    """Save target layers `layers` (in that order, renumbered 0..) as a checkpoint in
    `out_dir`; returns `out_dir`."""
    config = json.loads((target_dir / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    if not layers or any(not 0 <= i < num_layers for i in layers):
        raise ValueError(f"layers must be indices of the target's {num_layers} layers: {layers}")
    renumber = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            match = _LAYER.match(name)
            if match is None:
                tensors[name] = tensor  # embedding, final norm, head
            elif int(match[2]) in renumber:
                tensors[f"{match[1]}{renumber[int(match[2])]}{match[3]}"] = tensor
    out_dir.mkdir(parents=True, exist_ok=True)
    for pattern in _COPIED:
        for path in target_dir.glob(pattern):
            shutil.copy(path, out_dir / path.name)
    config["num_hidden_layers"] = len(layers)
    for per_layer in ("layer_types", "sliding_window_pattern"):
        if isinstance(config.get(per_layer), list):
            config[per_layer] = [config[per_layer][i] for i in layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "source_gguf.txt").unlink(missing_ok=True)  # not the target's GGUF any more
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")
    return out_dir
