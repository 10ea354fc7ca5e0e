"""The lines of the placement log and the names in them.

A line is ``<name>: (<ATen operator>): <device>`` (see :mod:`towerflow.devices.log`
for the whole format). Here are its pieces, shared by whoever writes lines:
the per-thread frames of module calls that make names unique
(:class:`OpNamer`), the ATen operator an operation ran (:class:`AtenRecorder`),
and the lines of tensor creations and parameter updates, held back until the
tensor's path is known (:func:`hold_op`, :func:`log_tensor_op`, :func:`claim`,
:func:`flush`). :mod:`towerflow.devices.log` turns the log on and off and
tracks module calls; :mod:`towerflow.devices.grads` writes the backward pass's
lines; the placer (:mod:`towerflow.devices.placer`) writes the others.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from towerflow.devices import params as _params

__all__ = ["LOGGER_NAME", "logger", "OpNamer", "AtenRecorder", "python_name", "aten_name",
           "log_op", "hold_op", "log_tensor_op", "claim", "flush", "restart_names"]

LOGGER_NAME = "towerflow.placement"
logger = logging.getLogger(LOGGER_NAME)


class _Frame:
    """One module call on the stack: its path prefix and the op names used in it."""

    __slots__ = ("module", "prefix", "counts", "children", "called")

    def __init__(self, module: torch.nn.Module | None, prefix: str) -> None:
        self.module = module
        self.prefix = prefix
        self.counts: dict[str, int] = {}
        self.children: dict[int, str] | None = None
        self.called: set[int] = set()  # top level: the modules called since names restarted

    def restart(self) -> None:
        self.counts.clear()
        self.called.clear()

    def unique(self, name: str) -> str:
        seen = self.counts.get(name, 0)
        self.counts[name] = seen + 1
        return name if seen == 0 else f"{name}_{seen}"

    def child_name(self, module: torch.nn.Module) -> str:
        if self.module is None:
            return ""
        if self.children is None:
            self.children = {
                id(child): "" if _params.unwrap_child(self.module, name) else name
                for name, child in self.module.named_children()
            }
        name = self.children.get(id(module))
        return name if name is not None else self.unique(type(module).__name__.lower())


class _Frames(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = [_Frame(None, "")]
        self.held: list[_Held] = []


_frames = _Frames()


_PY_NAMES: dict[Callable[..., Any], str] = {}


def python_name(func: Callable[..., Any]) -> str:
    """The short Python name of an operation (``add`` for ``Tensor.__add__``)."""
    name = _PY_NAMES.get(func)
    if name is None:
        raw = getattr(func, "__name__", None) or str(func)
        name = raw.rsplit(".", 1)[-1]
        if len(name) > 4 and name.startswith("__") and name.endswith("__"):
            name = name[2:-2]
        _PY_NAMES[func] = name
    return name


class OpNamer:
    """Gives each logged operation its TensorFlow-style name."""

    __slots__ = ()

    @staticmethod
    def name(func: Callable[..., Any]) -> str:
        """``conv1/conv2d`` for ``F.conv2d`` inside the child module ``conv1``."""
        frame = _frames.stack[-1]
        return frame.prefix + frame.unique(python_name(func))

    @staticmethod
    def peek(func: Callable[..., Any]) -> str:
        """The name :meth:`name` would give next, without using it up."""
        frame = _frames.stack[-1]
        base = python_name(func)
        seen = frame.counts.get(base, 0)
        return frame.prefix + (base if seen == 0 else f"{base}_{seen}")


class AtenRecorder(TorchDispatchMode):
    """Records the ATen operators one logged operation dispatches to."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, Any]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, out))
        return out

    def aten_name(self, result: Any, fallback: str) -> str:
        """The name (``aten::convolution``) of the ATen operator that produced ``result``.

        Book-keeping operators (``detach``, ``alias``) are passed over; without a
        producer the last operator run is named, and ``fallback`` when none ran.
        """
        return aten_name(self.calls, result, fallback)


_BOOKKEEPING = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def aten_name(calls: list[tuple[Any, Any]], result: Any, fallback: str) -> str:
    """The name of the operator among ``calls`` that produced ``result`` (see AtenRecorder)."""
    calls = [call for call in calls if call[0] not in _BOOKKEEPING] or calls
    if not calls:
        return fallback
    first = result[0] if isinstance(result, (list, tuple)) and result else result
    func = calls[-1][0]
    for candidate, out in calls:
        produced = out[0] if isinstance(out, (list, tuple)) and out else out
        if produced is first:
            func = candidate
            break
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


class _Held:
    """A log line held back until the name of the tensor it concerns is known."""

    __slots__ = ("name", "aten", "device", "note", "entry", "storage")

    def __init__(self, name: str, aten: str, device: str, note: str,
                 entry: Any = None, storage: int = 0) -> None:
        self.name = name          # the operation's own name (a suffix when entry is set)
        self.aten = aten
        self.device = device
        self.note = note
        self.entry = entry        # the parameter / buffer it concerns, once known
        self.storage = storage    # data pointer of a created tensor, to claim it

    def emit(self) -> None:
        name, device = self.name, self.device
        if self.entry is not None:
            path = _params.path_of(self.entry)
            name = f"{path}/{name}" if name else path
            placement = self.entry.placement
            if placement is not None:
                device = placement.spec.to_string()
        logger.info("%s: (%s): %s%s", name, self.aten, device, self.note)


def restart_names() -> None:
    """Start the top-level names again (a training step ended)."""
    _frames.stack[0].restart()


def flush() -> None:
    """Write the held-back lines of this thread, naming tensors by their paths now."""
    held = _frames.held
    if held:
        lines = held[:]
        held.clear()
        for line in lines:
            line.emit()


def log_op(name: str, aten: str, device_name: str, note: str = "") -> None:
    """Emit one placement line (after the lines held back before it)."""
    if _frames.held:
        flush()
    logger.info("%s: (%s): %s%s", name, aten, device_name, note)


def hold_op(name: str, aten: str, device_name: str, note: str, result: Any) -> None:
    """Hold the line of a tensor creation: the tensor may become a parameter (:func:`claim`)."""
    storage = 0
    if isinstance(result, torch.Tensor):
        try:
            storage = result.untyped_storage().data_ptr()
        except RuntimeError:  # a tensor without storage (meta, functional)
            storage = 0
    _frames.held.append(_Held(name, aten, device_name, note, None, storage))


def log_tensor_op(entry: Any, func: Callable[..., Any], aten: str, device_name: str,
                  note: str = "") -> None:
    """Hold the line of an operation on a parameter or buffer (``conv1/weight/normal_``)."""
    _frames.held.append(_Held(entry.unique(python_name(func)), aten, device_name, note, entry))


def claim(tensor: torch.Tensor, entry: Any) -> None:
    """Name the held creation line of a tensor that became a parameter or buffer."""
    held = _frames.held
    if not held:
        return
    try:
        storage = tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return
    if storage == 0:
        return
    for line in reversed(held):
        if line.entry is None and line.storage == storage:
            line.entry, line.name = entry, ""
            return


atexit.register(flush)
