#!/usr/bin/env python3
"""The package-level import graph of towerflow: for each package, the packages it imports.

A package is ``towerflow.X``, and inside the ps wing ``towerflow.ps.Y`` (``spec``, ``wire``,
``server``, ``worker``) and ``towerflow.ps.server.Z`` / ``towerflow.ps.worker.Z``; a module
at a package's root counts as that package. The graph is import-linter's own (grimp), built
from the installed source without running it.

Usage: python scripts/import_graph.py
"""

from __future__ import annotations

from collections import defaultdict

import grimp


def package_of(module: str, packages: set[str]) -> str:
    """The deepest package of the picture that holds ``module``."""
    parts = module.split(".")
    depth = 4 if parts[:2] == ["towerflow", "ps"] and parts[2:3] in (["server"], ["worker"]) \
        else 3 if parts[:2] == ["towerflow", "ps"] else 2
    for cut in range(min(depth, len(parts)), 2, -1):
        if ".".join(parts[:cut]) in packages:
            return ".".join(parts[:cut])
    return ".".join(parts[:2])  # a top-level package or module (towerflow.errors)


def main() -> None:
    graph = grimp.build_graph("towerflow")
    packages = {m for m in graph.modules if graph.find_children(m)}
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        here = package_of(module, packages)
        edges[here] |= {package_of(m, packages)
                        for m in graph.find_modules_directly_imported_by(module)} - {here}
    for package in sorted(edges):
        print(f"{package} -> {', '.join(sorted(edges[package])) or '(nothing)'}")


if __name__ == "__main__":
    main()
