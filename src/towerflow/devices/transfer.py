"""Batches follow the model: :func:`move_to_device` and the device a model computes on.

With a GPU visible, a strategy puts the model's compute on it (GPU first, as
TensorFlow places ops); a program's batches come from the CPU. TensorFlow
copies a feed to the device of the op that reads it; here every strategy's
``run_step`` (and so the ``Trainer``, the ``Supervisor``'s session and the
built-in tasks) hands the loss function its batch moved once per step by
:func:`move_to_device`, the one function that does it, as Lightning's
``move_data_to_device`` and accelerate's ``send_to_device`` do:

* tensors nested in dicts, lists, tuples, namedtuples and dataclasses (and
  objects with a ``to(device)`` method of their own, such as a
  ``PackedSequence``) are moved; everything else is left as it is;
* a tensor already on the device is not copied (a structure none of whose
  tensors moved is returned itself);
* dtypes are kept;
* a copy from pinned host memory does not block the host (``non_blocking``).

With the placement log on, each copy is logged as TensorFlow's log shows a
transfer: ``batch/<where in the batch>/_to_device: (aten::_to_copy): <device>
(copied from <device>)``.

Where the compute goes (:func:`compute_device`): the device a program names
(``device=`` of a strategy, ``--device`` of the command line), else the
``TOWERFLOW_DEVICE`` environment variable (``cpu`` chooses the CPU for any
program unchanged), else the lowest-numbered visible GPU, else the CPU.

Example:
    >>> import torch
    >>> batch = {"ids": torch.arange(3), "label": torch.ones(3, dtype=torch.float64)}
    >>> moved = move_to_device(batch, torch.device("cpu"))
    >>> moved is batch
    True
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["move_to_device", "compute_device", "DEVICE_ENV", "same_device", "inputs_follow"]

#: the environment variable naming the device a program's model computes on by default
DEVICE_ENV = "TOWERFLOW_DEVICE"
#: device types towerflow's placement (scopes, the log) knows; others are used as given
_PLACED = ("cpu", "cuda")


def same_device(tensor_device: torch.device, device: torch.device) -> bool:
    """Whether a tensor on ``tensor_device`` is already on ``device`` (``cuda`` without an
    index meaning the current GPU)."""
    if tensor_device.type != device.type:
        return False
    if device.index is None or tensor_device.index == device.index:
        return True
    return device.type == "cpu"


def move_to_device(batch: Any, device: torch.device | str,
                   twins: dict[int, torch.Tensor] | None = None) -> Any:
    """``batch`` with every tensor it holds on ``device``.

    Args:
        batch: a tensor, or dicts, lists, tuples, namedtuples and dataclasses of
            them (any depth); other values are kept as they are.
        device: where the tensors go.
        twins: when given, filled with ``id(moved tensor) -> the tensor it was
            copied from`` for each tensor copied off the CPU (the table client
            takes a batch's ids from the host copy, never back from the device).

    Returns:
        The batch on ``device``: the same object where nothing had to move.
    """
    target = torch.device(device)
    log = _copy_logger()
    return _move(batch, target, twins, log, "batch")


def _move(value: Any, device: torch.device, twins: dict[int, torch.Tensor] | None,
          log: Callable[[str, torch.Tensor, torch.Tensor], None] | None, path: str) -> Any:
    if isinstance(value, torch.Tensor):
        if same_device(value.device, device):
            return value
        pinned = value.device.type == "cpu" and device.type == "cuda" and value.is_pinned()
        moved = value.to(device, non_blocking=pinned)
        if twins is not None and value.device.type == "cpu":
            twins[id(moved)] = value
        if log is not None:
            log(path, value, moved)
        return moved
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if isinstance(value, Mapping):
        items = {key: _move(item, device, twins, log, f"{path}/{key}")
                 for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return _rebuild_mapping(value, items)
    if isinstance(value, (tuple, list)):
        items = [_move(item, device, twins, log, f"{path}/{index}")
                 for index, item in enumerate(value)]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        try:
            return type(value)(items)
        except TypeError:  # a sequence subclass whose constructor takes other arguments
            return tuple(items) if isinstance(value, tuple) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)
                  if hasattr(value, field.name)}
        moved = {name: _move(item, device, twins, log, f"{path}/{name}")
                 for name, item in fields.items()}
        if all(moved[name] is item for name, item in fields.items()):
            return value
        clone = copy.copy(value)
        for name, item in moved.items():  # frozen dataclasses too
            object.__setattr__(clone, name, item)
        return clone
    to = getattr(value, "to", None)
    if callable(to) and not isinstance(value, (torch.nn.Module, type)):
        try:  # a type that knows how to move itself (PackedSequence...)
            return to(device)
        except (TypeError, ValueError):  # a ``to`` of another meaning (units...): not a device's
            return value
    return value


def inputs_follow(model: torch.nn.Module, device: torch.device) -> Any:
    """Have every call of ``model`` take its arguments on ``device`` (a forward pre-hook run
    before any other, as Keras moves a layer's inputs at its call): a program's own call
    (an evaluation, a check before training) feeds the model as ``run_step`` does. Returns
    the hook's handle."""

    def _to_model_device(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        given = (args, kwargs)
        moved = move_to_device(given, device)
        return None if moved is given else moved

    return model.register_forward_pre_hook(_to_model_device, prepend=True, with_kwargs=True)


def _rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of ``original``'s type holding ``items`` (a plain dict when it cannot)."""
    if isinstance(original, dict) and type(original) is not dict:
        clone = copy.copy(original)  # keeps a defaultdict's factory, an OrderedDict's order
        clone.update(items)
        return clone
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def _copy_logger() -> Callable[[str, torch.Tensor, torch.Tensor], None] | None:
    """One placement-log line per copy when the log is on, else None."""
    from towerflow.devices import settings

    if not settings.get_config().log_device_placement:
        return None
    from towerflow.devices.local import full_name
    from towerflow.devices.loglines import log_op

    def log(path: str, source: torch.Tensor, moved: torch.Tensor) -> None:
        log_op(f"{path}/_to_device", "aten::_to_copy", full_name(moved.device),
               f" (copied from {full_name(source.device)})")

    return log


def compute_device(device: str | torch.device | None = None, *,
                   env: Mapping[str, str] | None = None) -> torch.device:
    """The device a strategy's model computes on.

    ``device`` when given (with a device type: ``/job:worker/task:1`` names none); else
    ``TOWERFLOW_DEVICE`` from ``env`` (default
    ``os.environ``) when set; else the device new tensors go to here (the
    current ``towerflow.device`` scope's, the configured default, the
    lowest-numbered visible GPU, the CPU). CPU and CUDA names take every
    form :func:`~towerflow.devices.resolve_device` accepts (``/gpu:0``,
    ``cuda:1``, ``cpu``); a device of another type PyTorch has (``mps``,
    ``xpu``, ``lazy``) is used as it is named, outside towerflow's placement.

    Raises:
        InvalidArgumentError: the name is no device (the variable's name is given).
        PlacementError: a CPU or GPU device that does not exist here.

    Example:
        >>> compute_device("cpu", env={"TOWERFLOW_DEVICE": "cuda:3"})
        device(type='cpu')
        >>> compute_device(env={"TOWERFLOW_DEVICE": "/cpu:0"})
        device(type='cpu')
    """
    from towerflow.devices.placer import resolve_device

    where = "device"
    if isinstance(device, str) and _no_device_type(device):  # '/job:worker/task:1': its default
        device = None
    if device is None:
        named = (os.environ if env is None else env).get(DEVICE_ENV, "").strip()
        if not named:
            return resolve_device(None)
        device, where = named, DEVICE_ENV
    other = _other_type(device)
    if other is not None:
        return other
    try:
        return resolve_device(device)
    except InvalidArgumentError as exc:
        if where == DEVICE_ENV:
            raise InvalidArgumentError(
                f"{DEVICE_ENV}={device!r} names no device ({exc}); set it to 'cpu', 'cuda:0' "
                f"or '/gpu:0', or unset it for the first GPU, else the CPU.") from None
        raise


def _no_device_type(name: str) -> bool:
    """Whether ``name`` names a task but no device (a setter's ``/job:worker/task:1``)."""
    from towerflow.devices.spec import DeviceSpec

    try:
        return DeviceSpec.from_string(name).device_type is None
    except InvalidArgumentError:
        return False


def _other_type(device: str | torch.device) -> torch.device | None:
    """``device`` as a ``torch.device`` when PyTorch knows its type and towerflow's placement
    does not (``mps``, ``xpu``, ``lazy``...), else None."""
    try:  # TensorFlow's forms ('/gpu:0', 'GPU:1', 'device:CPU:0') are no torch.device
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        return None
    return None if parsed.type in _PLACED else parsed
