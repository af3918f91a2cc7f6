"""A git revision of this repository checked out beside it, for benchmarks that time the code
as it is against the code as it was (--compare-ref), in alternated rounds of one run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
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


def alternated_rounds(
    root: Path,
    ref: str | None,
    prefix: str,
    rounds: int,
    measure: Callable[[Path], dict],
    on_round: Callable[[str, dict], None] | None = None,
) -> dict[str, list[dict]]:
    """{label: one result per round}: `measure(checkout)` on `root` ("current") and, with a
    ref, on a worktree of it (labelled by the ref), alternated round by round, so that a
    drift in the machine's load hits both. on_round(label, result) after each measurement."""
    roots = {"current": root}
    with ref_worktree(root, ref, prefix) as tree:
        if tree is not None:
            roots[ref] = tree
        runs: dict[str, list[dict]] = {label: [] for label in roots}
        for _ in range(rounds):
            for label, checkout in roots.items():
                runs[label].append(measure(checkout))
                if on_round is not None:
                    on_round(label, runs[label][-1])
    return runs
