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

This module turns the log on and off and tracks the module calls; the names
and the lines themselves are :mod:`towerflow.devices.loglines`'s.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from towerflow.devices import grads
from towerflow.devices import loglines as _lines
from towerflow.devices import params as _params
from towerflow.devices.local import full_name, list_local_devices, task_prefix
from towerflow.devices.loglines import (
    LOGGER_NAME,
    AtenRecorder,
    OpNamer,
    claim,
    flush,
    hold_op,
    log_op,
    log_tensor_op,
    logger,
    restart_names,
)

__all__ = ["LOGGER_NAME", "logger", "set_enabled", "device_mapping_lines", "OpNamer",
           "AtenRecorder", "log_op", "hold_op", "log_tensor_op", "claim", "flush",
           "restart_names"]


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
        del _lines._frames.stack[1:]  # frames left by a log turned off inside a forward
        _lines._frames.stack[0].restart()  # like a new session: top-level names start again
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


def _enter_module(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    frames = _lines._frames
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
    stack.append(_lines._Frame(module, prefix))


def _exit_module(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    stack = _lines._frames.stack
    if len(stack) > 1 and stack[-1].module is module:
        frame = stack.pop()
        if type(module).__name__ == "OptimizedModule":
            device = _output_device(output)
            if device is not None:
                name = frame.prefix + stack[-1].unique("compiled")
                log_op(name, "torch.compile", full_name(device))
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
