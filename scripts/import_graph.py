#!/usr/bin/env python3
"""The package-level import graph of towerflow: for each package, the packages it imports.

A package is ``towerflow.X`` (and ``towerflow.ps.Y`` / ``towerflow.ps.Y.Z`` inside the ps wing);
a module at a package's root counts as that package. Reads the source as text (ast), runs nothing.

Usage: python scripts/import_graph.py [src]
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def package_of(module: str) -> str:
    """The package ``module`` (a dotted name; ``pkg.__init__`` for a package's own file) counts in."""
    parts = module.split(".")
    if parts[-1] == "__init__":
        parts = parts[:-1] + ["__init__"] if len(parts) > 2 else parts[:-1]
    if parts[:2] == ["towerflow", "ps"]:
        # towerflow.ps.server.dense.shard -> towerflow.ps.server.dense
        depth = 4 if len(parts) > 4 and parts[2] in ("server", "worker") else 3
        return ".".join(parts[:depth]) if len(parts) > depth else ".".join(parts[:-1]) or module
    return ".".join(parts[:2]) if len(parts) > 2 else ".".join(parts)


def main(src: str = "src") -> None:
    root = Path(src)
    modules = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = package_of(name + ".__init__") if is_pkg else package_of(name)
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if is_pkg else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if not target.startswith("towerflow"):
                    continue
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                there = (package_of(target + ".__init__")
                         if modules.get(target, Path()).name == "__init__.py" else package_of(target))
                if there != here:
                    edges[here].add(there)
    for package in sorted({package_of(m) for m in modules} | set(edges)):
        print(f"{package} -> {', '.join(sorted(edges.get(package, ()))) or '(nothing)'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
