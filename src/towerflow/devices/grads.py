"""The backward pass in the placement log: ``gradients/conv1/conv2d_grad`` lines.

TensorFlow builds the gradient of an operation ``conv1/Conv2D`` as operations
under ``gradients/conv1/Conv2D_grad/`` and logs their devices like any other.
towerflow does the same for PyTorch's autograd: when the log is on, the
autograd node that a logged operation created gets a pre- and a post-hook,
and a backward call (``loss.backward()``, ``torch.autograd.backward`` or
``torch.autograd.grad``) runs under a dispatch mode that records the ATen
operators each node runs. When the node is done one line is written::

    gradients/conv1/conv2d_grad: (aten::convolution_backward): /job:localhost/replica:0/task:0/device:CPU:0

naming the node's main operator (the ``*_backward`` one when there is one)
and the device of the gradient it produced. A backward call at top level ends
a training step: the top-level names start again after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from towerflow.devices import loglines as _lines
from towerflow.devices.local import full_name

__all__ = ["hook_result", "run_backward"]


class _BackwardRecorder(TorchDispatchMode):
    """Records the ATen operators run during one backward call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, out))
        return out


class _Local(threading.local):
    def __init__(self) -> None:
        self.recorder: _BackwardRecorder | None = None
        self.marks: list[int] = []


_local = _Local()


def _first_tensor(values: Any) -> torch.Tensor | None:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, (list, tuple)):
        for value in values:
            if isinstance(value, torch.Tensor):
                return value
    return None


_VIEWS = frozenset({"aten::t", "aten::view", "aten::expand", "aten::unsqueeze", "aten::squeeze",
                    "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
                    "aten::permute", "aten::transpose", "aten::detach", "aten::alias"})


def _main_operator(calls: list[tuple[Any, Any]], fallback: str) -> str:
    """The ``*_backward`` operator, else the first that computes, else the first that ran."""
    names = [str(func._schema.name) for func, _ in calls if hasattr(func, "_schema")]
    for name in names:
        if name.endswith("_backward") or "_backward_" in name:
            return name
    computing = [name for name in names if name not in _VIEWS]
    return (computing or names or [fallback])[0]


def _make_hooks(name: str, node_name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    def before(grad_outputs: Any) -> None:
        recorder = _local.recorder
        _local.marks.append(len(recorder.calls) if recorder is not None else 0)

    def after(grad_inputs: Any, grad_outputs: Any) -> None:
        mark = _local.marks.pop() if _local.marks else 0
        recorder = _local.recorder
        calls = recorder.calls[mark:] if recorder is not None else []
        tensor = _first_tensor(grad_inputs)
        if tensor is None:
            tensor = _first_tensor(grad_outputs)
        if tensor is None:
            return
        aten = "torch.compile" if node_name.startswith("Compiled") else \
            _main_operator(calls, node_name)
        _lines.log_op(f"gradients/{name}_grad", aten, full_name(tensor.device))

    return before, after


def hook_result(name: str, result: Any) -> None:
    """Log the backward of the operation ``name`` that produced ``result``."""
    tensor = _first_tensor(result)
    if tensor is None or tensor.grad_fn is None or torch.compiler.is_compiling():
        return
    node = tensor.grad_fn
    before, after = _make_hooks(name, node.name())
    node.register_prehook(before)
    node.register_hook(after)


def run_backward(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """Run a backward call with the recorder that names each node's operator."""
    if _local.recorder is not None:
        return func(*args, **kwargs)
    _lines.flush()
    recorder = _BackwardRecorder()
    _local.recorder = recorder
    try:
        with recorder:
            return func(*args, **kwargs)
    finally:
        _local.recorder = None
        _local.marks.clear()
        if len(_lines._frames.stack) == 1:
            _lines.restart_names()  # a training step ends with its backward pass
