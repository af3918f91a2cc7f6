"""The repository's import rules, read from the source: no cycles in services/bench, no upward
arrows from the scheduler and executor to the engine, no edits of the import path, no shadowed
packages."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PACKAGES = ("services", "shared", "kernels")  # what pyproject.toml installs
# Not the project's own files: environments, caches, build output.
SKIPPED_DIRS = {".venv", "venv", ".git", "build", "dist", "node_modules", "__pycache__"}


def _python_files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(ROOT).parts[:-1]
        if not any(part in SKIPPED_DIRS or part.startswith(".") for part in parts):
            yield path


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in the file names, at any depth (a function-level import
    closes a cycle at run time just as well). `from a import b` counts as a and a.b."""
    names: set[str] = set()
    package = _module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_through_a_function_level_import():
    # The checker itself: a two-module circle like the one bench/commands.py once had.
    assert _find_cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_bench_modules_import_each_other_without_a_cycle():
    files = list(_python_files(ROOT / "services" / "bench"))
    modules = {_module_name(f): f for f in files}
    graph = {
        name: {m for m in _imported_modules(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    assert len(graph) > 5, "services/bench was not found"
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle in services/bench: " + " -> ".join(cycle)


def test_scheduler_and_executor_do_not_import_the_engine():
    # The engine drives both wings; an arrow back would make the layers a circle.
    upward = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for wing in ("scheduler", "executor")
        for path in _python_files(ROOT / "services" / wing)
        for name in _imported_modules(path)
        if name == "services.engine" or name.startswith("services.engine.")
    )
    assert upward == []


def _import_path_edits(source: str, filename: str = "<source>") -> Iterator[int]:
    """Line numbers where the source changes the import path (`path` of `sys`): a method call
    on it (insert, append, extend, ...), an assignment to it or to one of its items, or an
    augmented assignment."""

    def is_import_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_import_path(node.func.value):
                yield node.lineno
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if is_import_path(target) or (
                    isinstance(target, ast.Subscript) and is_import_path(target.value)
                ):
                    yield node.lineno


def test_import_path_edit_finder_sees_each_kind():
    # Spelled out of parts, so that a plain text search of the repository finds no edit here.
    edits = [f"sys.{'path'}.insert(0, 'x')", f"sys.{'path'} += ['y']", f"sys.{'path'}[0] = 'z'"]
    source = "\n".join(["import sys", *edits, "sys.argv"]) + "\n"
    assert sorted(_import_path_edits(source)) == [2, 3, 4]


def test_no_file_in_the_repository_edits_the_import_path():
    # Scripts import the installed package; tests and tools find it the same way.
    edits = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _python_files(ROOT)
        for line in _import_path_edits(path.read_text(), str(path))
    ]
    assert edits == []


def test_no_benchmark_script_hides_an_installed_package():
    # A script's own folder comes first on the import path: benchmarks/kernels.py once hid
    # `kernels`.
    scripts = {p.stem for folder in ("benchmarks", "scripts") for p in (ROOT / folder).glob("*.py")}
    assert scripts, "no scripts found"
    assert scripts.isdisjoint(PACKAGES)
