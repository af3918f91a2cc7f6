"""Hugging Face Hub ids: the snapshot directory of `org/name[@revision]` in the Hub's cache."""

from __future__ import annotations

import os
from pathlib import Path

from shared.errors import ModelNotFoundError

# Only what the engine reads: config, generation defaults, tokenizer, chat template, weights.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
]


def hub_cache_dir() -> Path:
    """The Hub's cache directory as huggingface_hub resolves it, read now: huggingface_hub reads
    its environment once, at import, and a test or caller may set it after that."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser()
    default_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.path.expandvars(os.environ.get("HF_HOME") or default_home)).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, but read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_snapshot(model: str, download_dir: str | None = None) -> Path:
    """The local snapshot of Hub id `org/name[@revision]` (revision: a branch, tag or commit;
    default main), downloading the files the engine reads unless HF_HUB_OFFLINE is set.
    `download_dir` replaces the Hub's cache directory (the same layout)."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = model.partition("@")
    cache_dir = Path(download_dir).expanduser() if download_dir else hub_cache_dir()
    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache_dir,
            local_files_only=offline,
            allow_patterns=HUB_FILES,
            token=os.environ.get("HF_TOKEN") or None,  # None: the token `hf auth login` saved
        )
    except (OSError, ValueError) as exc:  # huggingface_hub's errors are OSErrors or ValueErrors
        at = f" at revision {revision!r}" if revision else ""
        if offline:
            why = (
                f"is not in the Hugging Face cache {cache_dir} and HF_HUB_OFFLINE is set: "
                f"download it where the Hub is reachable (hf download {repo_id}), point "
                "HF_HUB_CACHE or --download-dir at a cache that holds it, or give a local "
                "directory"
            )
        else:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            why = (
                f"could not be fetched from the Hugging Face Hub and is not in the cache "
                f"{cache_dir} ({type(exc).__name__}: {reason})"
            )
        raise ModelNotFoundError(
            f"model {repo_id!r}{at} {why}", param="model", code="model_not_found"
        ) from None
    return Path(path)
