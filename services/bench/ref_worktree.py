"""A git revision of this repository checked out beside it, for benchmarks that time the code
as it is against the code as it was (--compare-ref), in alternated rounds of one run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def ref_worktree(root: Path, ref: str | None, prefix: str) -> Iterator[Path | None]:
    """A detached worktree of `root`'s repository at `ref` (None: yields None), removed after."""
    if ref is None:
        yield None
        return
    tree = Path(tempfile.mkdtemp(prefix=prefix)) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), ref],
        cwd=root, check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root)


def run_worker(
    script: Path, root: Path, argv: list[str], env: dict[str, str] | None = None
) -> dict:
    """`script --worker *argv` run against the checkout at `root` (its package first on the
    path), which prints one JSON line last; that line, parsed."""
    environ = {**os.environ, **(env or {}), "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(script), "--worker", *argv],
        cwd=root, env=environ, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])
