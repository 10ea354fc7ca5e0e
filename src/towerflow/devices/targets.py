"""Where the placer sends an operation: the target of a scope's spec, and inputs moved there.

A spec resolves once per scope change to a target (:func:`resolve_spec`): an
existing local device; the CPU with a note when soft placement stands in for a
device that does not exist; the CPU marked *missing* when it does not exist
and soft placement is off (the operation is then refused); or another task
(``remote``), where only a ``ps`` task may have its parameters created here.
The placer (:mod:`towerflow.devices.placer`) keeps the current scope's target
and copies a computing operation's inputs to it (:func:`move`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from towerflow import _identity
from towerflow.devices import settings as _settings
from towerflow.devices.local import gpu_count
from towerflow.devices.messages import missing_message
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import PlacementError

__all__ = [
    "CPU", "DYNAMIC", "NO_TARGET", "Target", "check_default_device", "default_target",
    "full_spec", "move", "no_kernel", "resolve_spec", "result_device", "target_for",
    "wrong_device", "wrong_in",
]


class Target:
    """Where operations of the current scope go (resolved once per scope change)."""

    __slots__ = ("device", "index", "spec", "missing", "note", "soft", "remote", "ps")

    def __init__(self, device: torch.device | None, spec: DeviceSpec | None = None, *,
                 missing: bool = False, note: str = "", soft: bool = False,
                 remote: str = "", ps: bool = False) -> None:
        self.device = device
        self.index = -1 if device is None or device.type == "cpu" else int(device.index or 0)
        self.spec = spec          # what was asked for (for messages)
        self.missing = missing    # asked-for device does not exist and no soft placement
        self.note = note          # appended to log lines (soft placement)
        self.soft = soft          # an op with no kernel there falls back to the CPU
        self.remote = remote      # the full name of another task's device ("" when local)
        self.ps = ps              # that task holds parameters: creating them is allowed


NO_TARGET = Target(None)
DYNAMIC = Target(None)  # a device function decides per operation
CPU = torch.device("cpu")


def _other_task(spec: DeviceSpec) -> str:
    """The task prefix of ``spec`` when it names a task other than this process's, else ``""``."""
    if spec.job is None and spec.task is None and spec.replica is None:
        return ""
    job, replica, task = _identity.current()
    if spec.job in (None, job) and spec.replica in (None, replica) and spec.task in (None, task):
        return ""
    return (f"/job:{spec.job or job}/replica:{spec.replica or 0}/task:"
            f"{0 if spec.task is None else spec.task}")


def full_spec(spec: DeviceSpec) -> DeviceSpec:
    """``spec`` completed with this process's job / task and the CPU, as a placer would."""
    job, replica, task = _identity.current()
    same_job = spec.job in (None, job)
    return DeviceSpec(
        spec.job or job, replica if spec.replica is None else spec.replica,
        (task if same_job else 0) if spec.task is None else spec.task,
        spec.device_type or "CPU", spec.device_index or 0,
    )


def target_for(spec: DeviceSpec, soft: bool, *, auto: bool = False) -> Target:
    """Resolve the local part of ``spec`` (type and index) to an existing device."""
    if spec.device_type == "CPU":
        exists = spec.device_index in (None, 0)
        device = CPU
    else:
        index = spec.device_index or 0
        exists = index < gpu_count()
        device = torch.device("cuda", index)
    soft = soft or auto
    if exists:
        return Target(device, spec, soft=soft)
    if soft:
        note = f" (soft placement: no device matches '{spec.to_string()}')"
        return Target(CPU, spec, note=note, soft=True)
    return Target(CPU, spec, missing=True)


def default_target(config: _settings.DeviceConfig) -> Target:
    """The target of operations outside every scope: ``config.default_device``'s."""
    default = config.default_device
    if default is None:
        return NO_TARGET
    if default == "auto":
        if gpu_count() == 0:
            return NO_TARGET
        return Target(torch.device("cuda", 0), DeviceSpec("localhost", 0, 0, "GPU", 0),
                      soft=True)
    return target_for(DeviceSpec.from_string(default), config.allow_soft_placement)


def resolve_spec(spec: DeviceSpec | None, config: _settings.DeviceConfig) -> Target:
    """The target of operations whose scopes give them ``spec``."""
    if spec is None:
        return default_target(config)
    other = _other_task(spec)
    if other:
        local = default_target(config).device
        remote = full_spec(spec).to_string()
        return Target(local, spec, remote=remote, ps=spec.job == "ps")
    if spec.device_type is None:
        return default_target(config)
    return target_for(spec, config.allow_soft_placement)


def check_default_device(config: _settings.DeviceConfig) -> None:
    """Raise ``PlacementError`` now if ``config.default_device`` names no existing device."""
    target = default_target(config)
    if target.missing and target.spec is not None:
        what = f"default_device={config.default_device!r}"
        raise PlacementError(missing_message(what, target.spec))


def wrong_device(args: Any, kwargs: Mapping[str, Any], index: int) -> bool:
    """Whether a tensor among ``args`` and ``kwargs`` is not on the device of ``index``."""
    return wrong_in(args, index) or (bool(kwargs) and wrong_in(kwargs.values(), index))


def wrong_in(values: Any, index: int) -> bool:
    """Whether a tensor among ``values`` (or in a list / tuple there) is not on ``index``."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.get_device() != index:
                return True
        elif type(value) in (list, tuple):
            for item in value:
                if isinstance(item, torch.Tensor) and item.get_device() != index:
                    return True
    return False


def _movable(tensor: torch.Tensor, index: int) -> bool:
    return tensor.get_device() != index and (tensor.is_cpu or tensor.is_cuda)


def move(value: Any, device: torch.device, index: int, copies: list[torch.device]) -> Any:
    """``value`` with its tensors copied to ``device``; each copy's source goes to ``copies``."""
    if isinstance(value, torch.Tensor):
        if _movable(value, index):
            copies.append(value.device)
            return value.to(device)
        return value
    if type(value) in (list, tuple):
        return type(value)(move(item, device, index, copies) for item in value)
    return value


def result_device(result: Any, fallback: torch.device | None) -> torch.device:
    """The device of ``result`` (its first tensor), else ``fallback``, else the CPU."""
    if isinstance(result, torch.Tensor):
        return result.device
    if isinstance(result, (list, tuple)):
        for item in result:
            if isinstance(item, torch.Tensor):
                return item.device
    return fallback or CPU


def no_kernel(exc: BaseException, target: Target) -> bool:
    """A missing kernel: no backend kernel at all, or (on a GPU) none for the dtype."""
    text = str(exc)
    if isinstance(exc, NotImplementedError):
        return "Could not run" in text
    return target.index >= 0 and "not implemented for" in text
