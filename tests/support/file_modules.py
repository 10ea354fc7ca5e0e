"""Python files that are not importable by name (examples, benchmarks) loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_file(path: Path, name: str) -> ModuleType:
    """The file at ``path`` run as a fresh module called ``name`` (registered in
    ``sys.modules`` unless a module of that name is there already, so that its
    dataclasses find their module)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
