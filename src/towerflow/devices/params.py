"""Parameters and modules as the placer knows them: owners, paths and ps assignments.

While a placement scope or the placement log is active, PyTorch's global
registration hooks (``register_module_parameter_registration_hook`` and its
buffer and module siblings) tell this registry which module owns each new
parameter and under which name each module sits in its parent. From that it
answers:

* the path of a parameter (``conv1/weight``), used to name the operations
  that create, initialise and update it in the placement log;
* the device a scope assigned to a parameter when it was created
  (``/job:ps/replica:0/task:1/device:CPU:0``), which the parameter-server
  strategy uses as its placement: :func:`parameter_placements`.

The registry holds weak references only; a parameter or module that is
garbage collected leaves it.

Example:
    >>> import towerflow
    >>> setter = towerflow.replica_device_setter(ps_tasks=2)
    >>> with towerflow.device(setter):  # doctest: +SKIP
    ...     model = torch.nn.Linear(2, 2)
    >>> {name: p.spec.to_string() for name, p in parameter_placements(model).items()}  # doctest: +SKIP
    {'weight': '/job:ps/replica:0/task:0/device:CPU:0', 'bias': '/job:ps/replica:0/task:1/device:CPU:0'}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from towerflow.devices.spec import DeviceSpec

__all__ = ["ParameterPlacement", "parameter_placements", "install", "uninstall", "owner_of",
           "path_of", "assign", "note_prefix", "unwrap_child"]


@dataclass(frozen=True, slots=True)
class ParameterPlacement:
    """The device a placement scope gave a parameter when it was created.

    Attributes:
        spec: the full device (``/job:ps/replica:0/task:1/device:CPU:0``).
        source: the scope that decided it: the device function (e.g. a
            ``replica_device_setter``) or the device name.
    """

    spec: DeviceSpec
    source: Any


class _Entry:
    """What the registry knows about one parameter or buffer."""

    __slots__ = ("ref", "module", "name", "placement", "counts", "__weakref__")

    def __init__(self, ref: weakref.ref, module: nn.Module, name: str) -> None:
        self.ref = ref
        self.module: weakref.ref = weakref.ref(module)
        self.name = name
        self.placement: ParameterPlacement | None = None
        self.counts: dict[str, int] = {}

    def unique(self, op: str) -> str:
        """``op``, then ``op_1``, ... for the operations on this tensor."""
        seen = self.counts.get(op, 0)
        self.counts[op] = seen + 1
        return op if seen == 0 else f"{op}_{seen}"


_entries: dict[int, _Entry] = {}
_parents: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, str]] = \
    weakref.WeakKeyDictionary()
_prefixes: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_handles: list[RemovableHandle] = []
_users = 0
_on_parameter: Callable[[nn.Module, str, torch.Tensor], None] | None = None


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _entries.get(key)
    if entry is not None and entry.ref is ref:
        del _entries[key]


def _entry(tensor: torch.Tensor) -> _Entry | None:
    entry = _entries.get(id(tensor))
    if entry is not None and entry.ref() is tensor:
        return entry
    return None


def _record(module: nn.Module, name: str, tensor: Any) -> _Entry | None:
    if not isinstance(tensor, torch.Tensor):
        return None
    key = id(tensor)
    entry = _entry(tensor)
    if entry is None:
        ref = weakref.ref(tensor, lambda r, k=key: _forget(k, r))
        entry = _Entry(ref, module, name)
        _entries[key] = entry
    else:
        entry.module, entry.name = weakref.ref(module), name
    return entry


def _parameter_hook(module: nn.Module, name: str, param: Any) -> None:
    if _record(module, name, param) is not None and _on_parameter is not None:
        _on_parameter(module, name, param)


def _buffer_hook(module: nn.Module, name: str, buffer: Any) -> None:
    _record(module, name, buffer)


def _module_hook(module: nn.Module, name: str, submodule: Any) -> None:
    if isinstance(submodule, nn.Module):
        _parents[submodule] = (weakref.ref(module), name)


def install(on_parameter: Callable[[nn.Module, str, torch.Tensor], None]) -> None:
    """Start watching registrations (counted: as many :func:`uninstall` calls stop it).

    ``on_parameter(module, name, param)`` is called for every new parameter.
    """
    global _users, _on_parameter
    _on_parameter = on_parameter
    if _users == 0:
        module_api = torch.nn.modules.module
        _handles[:] = [
            module_api.register_module_parameter_registration_hook(_parameter_hook),
            module_api.register_module_buffer_registration_hook(_buffer_hook),
            module_api.register_module_module_registration_hook(_module_hook),
        ]
    _users += 1


def uninstall() -> None:
    """Undo one :func:`install`; the hooks go when the last user leaves."""
    global _users
    _users = max(_users - 1, 0)
    if _users == 0:
        for handle in _handles:
            handle.remove()
        _handles.clear()


def owner_of(tensor: Any) -> _Entry | None:
    """The registry's entry of a parameter or buffer (``None`` for any other tensor)."""
    if not _entries or not isinstance(tensor, torch.Tensor):
        return None
    return _entry(tensor)


def unwrap_child(parent: nn.Module, name: str) -> bool:
    """Whether ``name`` is the wrapped model of a wrapper (DDP's ``module``, compile's ``_orig_mod``).

    Such a child adds no path component, as the model it wraps is the same model.
    """
    if name == "module":
        return isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel))
    if name == "_orig_mod":
        return type(parent).__name__ == "OptimizedModule"
    return False


def note_prefix(module: nn.Module, prefix: str) -> None:
    """Remember the path a module was seen at during a forward pass (``conv1/``)."""
    _prefixes[module] = prefix


def module_path(module: nn.Module | None) -> str:
    """``conv1/`` for the child ``conv1`` of a root module; ``""`` for a root module."""
    parts: list[str] = []
    seen = 0
    while module is not None and seen < 64:
        seen += 1
        prefix = _prefixes.get(module)
        link = _parents.get(module)
        if link is None:
            return (prefix or "") + "".join(reversed(parts))
        parent, name = link[0](), link[1]
        if parent is not None and not unwrap_child(parent, name):
            parts.append(f"{name}/")
        module = parent
    return "".join(reversed(parts))


def path_of(entry: _Entry) -> str:
    """The path of a registered tensor: ``conv1/weight``."""
    return module_path(entry.module()) + entry.name


def assign(tensor: torch.Tensor, spec: DeviceSpec, source: Any) -> None:
    """Record the device a scope gave a parameter."""
    entry = _entry(tensor)
    if entry is not None:
        entry.placement = ParameterPlacement(spec, source)


def placement_of(entry: _Entry) -> ParameterPlacement | None:
    """The placement recorded for a registered tensor."""
    return entry.placement


def parameter_placements(model: nn.Module) -> dict[str, ParameterPlacement]:
    """The device each parameter of ``model`` was given by a scope when it was created.

    Keys are ``model.named_parameters()`` names; parameters created outside
    any scope naming a job or task are left out.

    Example:
        >>> parameter_placements(torch.nn.Linear(2, 2))
        {}
    """
    found: dict[str, ParameterPlacement] = {}
    for name, param in model.named_parameters():
        entry = _entry(param)
        if entry is not None and entry.placement is not None:
            found[name] = entry.placement
    return found
