"""Public names imported on first use (PEP 562), for the package ``__init__`` modules.

Example:
    >>> ns = {}
    >>> getattr_ = lazy_getattr("towerflow", {"DataLossError": "towerflow.errors"}, ns)
    >>> getattr_("DataLossError").__name__, "DataLossError" in ns
    ('DataLossError', True)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_getattr", "lazy_dir"]


def lazy_getattr(package: str, table: Mapping[str, str],
                 namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` importing ``name`` from ``table[name]``.

    Args:
        package: the package's name, for the error message.
        table: public name -> the module defining it (or, for a sub-package made public
            as itself, its own name: ``"serving": "towerflow.serving"``).
        namespace: the package's ``globals()``; a name is cached there once
            imported, so the next access costs nothing.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = importlib.import_module(module)
        if module != f"{package}.{name}":  # a name in a module, else the sub-package itself
            value = getattr(value, name)
        namespace[name] = value
        return value

    return __getattr__


def lazy_dir(namespace: Mapping[str, Any], public: Iterable[str]) -> Callable[[], list[str]]:
    """Return a module ``__dir__`` listing what is imported and the lazy ``public`` names."""
    names = frozenset(public)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | names)

    return __dir__
