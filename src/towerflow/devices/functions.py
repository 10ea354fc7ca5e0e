"""Device functions: a callable as a placement scope, as ``tf.device(fn)`` takes one.

A device function is asked, for each operation in its scope, where that
operation goes. It receives an :class:`Operation` (its name, its type, the
device the enclosing scopes give it and, for a parameter, its shape) and
returns a device name (or a ``DeviceSpec``, a ``torch.device`` or ``None``
for "no opinion")::

    def matmul_on_gpu(op):
        return "/gpu:0" if op.type == "matmul" else "/cpu:0"

    with towerflow.device(matmul_on_gpu):
        ...

A parameter registered on a module inside the scope is asked about as an
operation of type ``VariableV2`` (TensorFlow's variable op) named after the
parameter; this is how ``towerflow.replica_device_setter`` puts parameters
on ps tasks and everything else on the worker.

Scopes nest as TensorFlow's device stack does: from the outermost scope in,
a device name is merged into the device so far (its fields win) and a
function's answer replaces it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from towerflow.devices.spec import DeviceSpec
from towerflow.errors import InvalidArgumentError

__all__ = ["Operation", "VARIABLE_TYPE", "DeviceFunction", "ScopeItem", "evaluate", "describe"]

#: the type a parameter's creation has for a device function (TensorFlow's variable op)
VARIABLE_TYPE = "VariableV2"

#: what a device function returns
DeviceFunction = Callable[["Operation"], "str | DeviceSpec | torch.device | None"]
ScopeItem = DeviceSpec | Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation as a device function sees it.

    Attributes:
        name: the operation's name in the placement log (``conv1/conv2d``), or a
            parameter's name (``weight``; the module path is not known while the
            module is being built).
        type: ``VariableV2`` for a parameter, else the Python operation's name
            (``matmul``, ``zeros``, ``conv2d``).
        device: the device the enclosing scopes give it (``""`` for none).
        shape: a parameter's shape (``()`` for other operations).
    """

    name: str
    type: str
    device: str = ""
    shape: tuple[int, ...] = ()


def describe(function: Callable[..., Any]) -> str:
    """A short name for a device function in messages."""
    return getattr(function, "__qualname__", None) or repr(function)


def _as_spec(function: Callable[..., Any], result: Any) -> DeviceSpec | None:
    if result is None or isinstance(result, DeviceSpec):
        return result
    if isinstance(result, (str, torch.device)):
        return DeviceSpec.from_string(result)
    raise InvalidArgumentError(
        f"The device function {describe(function)} returned {result!r}; a device function "
        "must return a device name such as '/job:ps/task:0' or '/gpu:0', a DeviceSpec, a "
        "torch.device or None."
    )


def evaluate(chain: tuple[ScopeItem, ...], name: str, op_type: str,
             shape: tuple[int, ...] = ()) -> DeviceSpec | None:
    """Apply the scopes of ``chain`` (outermost first) to one operation.

    Example:
        >>> evaluate((DeviceSpec.from_string("/job:worker"), lambda op: "/gpu:0"), "add", "add")
        DeviceSpec('/device:GPU:0')
    """
    spec: DeviceSpec | None = None
    for item in chain:
        if isinstance(item, DeviceSpec):
            spec = item if spec is None else spec.make_merged_spec(item)
        else:
            device = spec.to_string() if spec is not None else ""
            spec = _as_spec(item, item(Operation(name, op_type, device, shape)))
    return spec
