"""A Hugging Face Hub cache laid out by hand (models--org--name/refs, snapshots), for Hub ids
served offline."""

from __future__ import annotations

import shutil
from pathlib import Path


def add_to_hub_cache(
    cache: Path, repo_id: str, model_dir: Path, commit: str, branch: str | None = "main"
) -> Path:
    """Copy `model_dir`'s files into `cache` as snapshot `commit` of `repo_id` (and point
    `branch` at it); returns the snapshot directory. huggingface_hub keeps blobs and links the
    snapshot's files to them; plain files in the snapshot read the same."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    if branch is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot
