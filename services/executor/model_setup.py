"""What the executor settles from the config and the checkpoint before it loads weights: the
device, the dtype, the context limit and the end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def model_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """--dtype as a torch dtype. auto: fp32 on a CPU, where half-precision matmuls are slow; on
    other devices the dtype the checkpoint was saved in (bf16 for most), fp32 when it names
    none we run."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved.removeprefix("torch."))
    return saved if saved in (torch.float16, torch.bfloat16) else torch.float32


def pick_device(name: str, rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    if name == "cuda":
        # Ranks of one machine take one device each; ranks spread over machines started by
        # hand wrap around each machine's devices (rank 1 alone on a one-GPU machine: cuda:0).
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


def max_model_len(hf_config, requested: int | None) -> int:
    # Sliding windows (Mistral, Gemma 2) are applied by the attention kernels: a windowed model
    # serves its whole position range.
    limit = hf_config.max_position_embeddings
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit}")
    return requested or limit


# generation_config.json keys that are request sampling fields of the same name and meaning.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling parameters the checkpoint's generation_config.json sets (only those it
    names, as vLLM's --generation-config auto reads them; its do_sample is not consulted)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    return {
        key: saved[key]
        for key in SAMPLING_DEFAULT_KEYS
        if isinstance(saved.get(key), int | float) and not isinstance(saved[key], bool)
    }


def eos_token_ids(model_dir: Path, hf_config) -> tuple[int, ...]:
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))
