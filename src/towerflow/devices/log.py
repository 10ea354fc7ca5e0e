"""The placement log (``log_device_placement``): a device mapping, then a line per op.

Lines follow TensorFlow's format::

    Device mapping: no known devices.
    conv1/conv2d: (aten::convolution): /job:localhost/replica:0/task:0/device:CPU:0

The name is the module path (from the module hierarchy, tracked with
PyTorch's global module forward hooks while the log is on) plus the Python
operation, made unique within one call of a module (``add``, ``add_1``) as
TensorFlow makes names unique within a name scope; the part in brackets is
the ATen operator that ran (seen by a dispatch mode entered around each logged
operation). The root module adds no prefix, and the names at top level start
again whenever a top-level module is called, so a training loop logs the same
names at every step.

Records go to the logger ``towerflow.placement`` at INFO level. When the log
is turned on and that logger has no handler of its own, a handler writing to
stderr is attached (and removed when the log is turned off); attach your own
handler first to send the lines elsewhere.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from towerflow.devices.local import LOCAL_TASK, list_local_devices

__all__ = ["LOGGER_NAME", "logger", "set_enabled", "device_mapping_lines", "OpNamer",
           "AtenRecorder"]

LOGGER_NAME = "towerflow.placement"
logger = logging.getLogger(LOGGER_NAME)


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _LogState:
    """What turning the log on changed, so that turning it off restores it."""

    def __init__(self) -> None:
        self.handler: logging.Handler | None = None
        self.saved_level = logging.NOTSET
        self.saved_propagate = True
        self.hooks: list[RemovableHandle] = []


_log_state = _LogState()


def set_enabled(enabled: bool) -> None:
    """Turn the log's handler and module tracking on or off (idempotent)."""
    state = _log_state
    if enabled and not state.hooks:
        state.saved_level = logger.level
        state.saved_propagate = logger.propagate
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
        if not logger.handlers:
            state.handler = _CurrentStderrHandler()
            logger.addHandler(state.handler)
            logger.propagate = False
        state.hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(_enter_module),
            torch.nn.modules.module.register_module_forward_hook(
                _exit_module, always_call=True
            ),
        ]
        del _frames.stack[1:]  # frames left by a log turned off inside a forward
        _frames.stack[0].counts.clear()  # like a new session: top-level names start again
        for line in device_mapping_lines():
            logger.info(line)
    elif not enabled and state.hooks:
        for handle in state.hooks:
            handle.remove()
        state.hooks = []
        if state.handler is not None:
            logger.removeHandler(state.handler)
            state.handler = None
            logger.propagate = state.saved_propagate
        logger.setLevel(state.saved_level)


def device_mapping_lines() -> list[str]:
    """TensorFlow's ``Device mapping:`` header for the devices of this process.

    Example:
        >>> device_mapping_lines()  # on a machine without a GPU  # doctest: +SKIP
        ['Device mapping: no known devices.']
    """
    gpus = [d for d in list_local_devices() if d.physical_device_desc]
    if not gpus:
        return ["Device mapping: no known devices."]
    return ["Device mapping:"] + [
        f"{LOCAL_TASK}{d.name} -> {d.physical_device_desc}" for d in gpus
    ]


class _Frame:
    """One module call on the stack: its path prefix and the op names used in it."""

    __slots__ = ("module", "prefix", "counts", "children")

    def __init__(self, module: torch.nn.Module | None, prefix: str) -> None:
        self.module = module
        self.prefix = prefix
        self.counts: dict[str, int] = {}
        self.children: dict[int, str] | None = None

    def unique(self, name: str) -> str:
        seen = self.counts.get(name, 0)
        self.counts[name] = seen + 1
        return name if seen == 0 else f"{name}_{seen}"

    def child_name(self, module: torch.nn.Module) -> str:
        if self.module is None:
            return ""
        if self.children is None:
            self.children = {id(child): name for name, child in self.module.named_children()}
        name = self.children.get(id(module))
        return name if name is not None else self.unique(type(module).__name__.lower())


class _Frames(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = [_Frame(None, "")]


_frames = _Frames()


def _enter_module(module: torch.nn.Module, args: Any) -> None:
    stack = _frames.stack
    parent = stack[-1]
    if len(stack) == 1:
        parent.counts.clear()  # a new top-level call: names start again
    child = parent.child_name(module)
    prefix = f"{parent.prefix}{child}/" if child else parent.prefix
    stack.append(_Frame(module, prefix))


def _exit_module(module: torch.nn.Module, args: Any, output: Any) -> None:
    stack = _frames.stack
    if len(stack) > 1 and stack[-1].module is module:
        stack.pop()


_PY_NAMES: dict[Callable[..., Any], str] = {}


def _python_name(func: Callable[..., Any]) -> str:
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
        return frame.prefix + frame.unique(_python_name(func))

    @staticmethod
    def peek(func: Callable[..., Any]) -> str:
        """The name :meth:`name` would give next, without using it up."""
        frame = _frames.stack[-1]
        base = _python_name(func)
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
        calls = [call for call in self.calls if call[0] not in _BOOKKEEPING] or self.calls
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


_BOOKKEEPING = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def log_op(name: str, aten: str, device_name: str, note: str = "") -> None:
    """Emit one placement line."""
    logger.info("%s: (%s): %s%s", name, aten, device_name, note)
