"""The shape of the package: no two files import each other, no file runs past 600 lines.

An import circle between files (``a`` imports ``b``, ``b`` imports ``a``, at
any depth: at module level, inside a function, under ``TYPE_CHECKING``) ties
the files into one piece that can only be read, tested and changed together,
and a function-level import that "breaks" it at run time only hides it. Every
import of every file of ``src/towerflow`` is read with :mod:`ast`, resolved to
the file it names, and the strongly connected groups of the resulting graph
(Tarjan's algorithm) must all be single files.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import towerflow

PACKAGE_DIR = Path(towerflow.__file__).parent
MAX_LINES = 600


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by dotted name (a package: its
    ``__init__.py``)."""
    root = package_dir.parent
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _owner(name: str, files: dict[str, Path]) -> str | None:
    """The module of ``files`` that ``name`` (a module or a name in one) lives in."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              files: dict[str, Path]) -> Iterator[str]:
    """The dotted names one import statement of ``module`` reaches."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    prefix = node.module or ""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    for alias in node.names:
        submodule = f"{prefix}.{alias.name}"
        yield submodule if submodule in files else prefix


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the other modules of the package it imports, from every import statement
    anywhere in its file (function bodies and ``if TYPE_CHECKING:`` blocks included)."""
    files = module_files(package_dir)
    top = package_dir.name
    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, module, path.name == "__init__.py", files):
                target = _owner(name, files)
                if target and target != module and (target == top or target.startswith(top + ".")):
                    graph[module].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, without
    recursion), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return sorted(circles)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_no_two_files_of_the_package_import_each_other() -> None:
    circles = import_circles(import_graph(PACKAGE_DIR))
    assert not circles, "import circles between files:\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_no_file_of_the_package_is_over_600_lines() -> None:
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines())
             for path in PACKAGE_DIR.rglob("*.py") if not path.name.endswith("_pb2.py")}
    over = sorted(f"{path.relative_to(PACKAGE_DIR.parent)}: {lines} lines"
                  for path, lines in sizes.items() if lines > MAX_LINES)
    assert not over, f"files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(over)


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    package = _write_package(tmp_path, {
        "__init__.py": "",
        "a.py": "def late():\n    from pkg import b\n    return b\n",
        "b.py": "import pkg.a\n",
        "c.py": "from pkg.a import late\n",
    })
    assert import_circles(import_graph(package)) == [["pkg.a", "pkg.b"]]


def test_relative_and_type_checking_imports_count(tmp_path: Path) -> None:
    package = _write_package(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from .x import X\n",
        "sub/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from ..y import Y\nX = 1\n",
        "y.py": "from pkg.sub import x\nY = x.X\n",
    })
    graph = import_graph(package)
    assert graph["pkg.sub"] == {"pkg.sub.x"}
    assert graph["pkg.y"] == {"pkg.sub.x"}  # `from pkg.sub import x`: the module, not the package
    assert import_circles(graph) == [["pkg.sub.x", "pkg.y"]]


def test_a_name_from_a_package_is_an_import_of_its_init(tmp_path: Path) -> None:
    package = _write_package(tmp_path, {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "A = 1\n",
        "b.py": "from pkg import A\nimport json\n",
    })
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": set(), "pkg.b": {"pkg"}}
    assert import_circles(graph) == []
