"""A git revision of this repository checked out beside it, for benchmarks that time the code
as it is against the code as it was (--compare-ref), in alternated rounds of one run."""

from __future__ import annotations

import contextlib
import subprocess
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
