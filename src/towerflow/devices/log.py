"""The placement log (``log_device_placement``): a device mapping, then a line per op.

Lines follow TensorFlow's format::

    Device mapping: no known devices.
    conv1/weight: (aten::empty): /job:localhost/replica:0/task:0/device:CPU:0
    conv1/weight/kaiming_uniform_: (aten::uniform_): /job:localhost/replica:0/task:0/device:CPU:0
    conv1/conv2d: (aten::convolution): /job:localhost/replica:0/task:0/device:CPU:0
    gradients/conv1/conv2d_grad: (aten::convolution_backward): /job:localhost/replica:0/task:0/device:CPU:0

The name is the module path (from the module hierarchy, tracked with
PyTorch's global module forward hooks while the log is on) plus the Python
operation, made unique (``add``, ``add_1``) as TensorFlow makes names unique
within a name scope: within one call of a module, and at top level within one
training step (names start again after each backward pass, or, in a loop with
no backward pass, when a top-level module is called a second time), so a
training loop logs the same names at every step. The wrapper of a model (DDP's ``module``,
``torch.compile``'s ``_orig_mod``) adds no path component. The part in
brackets is the ATen operator that ran (seen by a dispatch mode entered around
each logged operation).

Operations on a parameter or buffer are named after it: its creation is
``conv1/weight`` and what initialises or updates it is
``conv1/weight/normal_``. Its path is only known once the model is built, so
these lines (and the line of a tensor creation that may become a parameter)
are held back until the next other operation, module call or the end of the
log. The backward pass of a logged operation is logged as
``gradients/<name>_grad``, and a module compiled with ``torch.compile`` as one
line ``<path>compiled: (torch.compile)`` per call (operations that fall back
to eager mode get their own lines).

The ``Device mapping:`` header is written once per process (and again only if
the devices change). Records go to the logger ``towerflow.placement`` at INFO
level. When the log is turned on and that logger has no handler of its own, a
handler writing to stderr is attached (and removed when the log is turned
off); attach your own handler first to send the lines elsewhere.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from towerflow.devices import params as _params
from towerflow.devices.local import list_local_devices, task_prefix

__all__ = ["LOGGER_NAME", "logger", "set_enabled", "device_mapping_lines", "OpNamer",
           "AtenRecorder", "log_op", "hold_op", "log_tensor_op", "claim", "flush",
           "restart_names"]

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
        self.header: list[str] | None = None  # the header last written in this process


_log_state = _LogState()
_COMPILE_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"


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
        # the log's own global hooks are what makes torch.compile warn; they are meant
        warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING)
        state.hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(_enter_module),
            torch.nn.modules.module.register_module_forward_hook(
                _exit_module, always_call=True
            ),
        ]
        del _frames.stack[1:]  # frames left by a log turned off inside a forward
        _frames.stack[0].restart()  # like a new session: top-level names start again
        header = device_mapping_lines()
        if header != state.header:
            state.header = header
            for line in header:
                logger.info(line)
    elif not enabled and state.hooks:
        flush()
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
        f"{task_prefix()}{d.name} -> {d.physical_device_desc}" for d in gpus
    ]


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


def _enter_module(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    frames = _frames
    if frames.held:
        flush()
    stack = frames.stack
    parent = stack[-1]
    if len(stack) == 1:  # a top-level call: a second call of the same module is a new step
        if id(module) in parent.called:
            parent.restart()
        parent.called.add(id(module))
    child = parent.child_name(module)
    prefix = f"{parent.prefix}{child}/" if child else parent.prefix
    _params.note_prefix(module, prefix)
    stack.append(_Frame(module, prefix))


def _exit_module(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    stack = _frames.stack
    if len(stack) > 1 and stack[-1].module is module:
        frame = stack.pop()
        if type(module).__name__ == "OptimizedModule":
            device = _output_device(output)
            if device is not None:
                from towerflow.devices import grads

                name = frame.prefix + stack[-1].unique("compiled")
                log_op(name, "torch.compile", _full_name(device))
                grads.hook_result(name, output)


def _output_device(output: Any) -> torch.device | None:
    if isinstance(output, torch.Tensor):
        return output.device
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _output_device(item)
            if found is not None:
                return found
    if isinstance(output, dict):
        return _output_device(list(output.values()))
    return None


def _full_name(device: torch.device) -> str:
    from towerflow.devices.local import full_name

    return full_name(device)


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
