"""The sentences of placement errors: the offending device and the way out."""

from __future__ import annotations

from typing import Any

from towerflow import _identity
from towerflow.devices.local import gpu_count, task_prefix
from towerflow.devices.spec import DeviceSpec

__all__ = ["available_devices", "missing_message", "remote_message"]


def available_devices() -> str:
    """The full names of this process's devices, for messages."""
    prefix = task_prefix()
    names = [f"{prefix}/device:CPU:0"]
    names += [f"{prefix}/device:GPU:{i}" for i in range(gpu_count())]
    return ", ".join(names)


def missing_message(what: str, spec: DeviceSpec) -> str:
    """``what`` asked for a device this process does not have."""
    return (
        f"Cannot assign a device for {what}: Could not satisfy explicit device specification "
        f"'{spec.to_string()}' because no devices matching that specification are registered "
        f"in this process; available devices: {available_devices()}. Set "
        f"allow_soft_placement=True to fall back to a device that exists."
    )


def remote_message(what: str, target: Any) -> str:
    """``what`` was placed on another task's device (``target``: the placer's target)."""
    job, _, task = _identity.current()
    spec = target.spec.to_string() if target.spec is not None else target.remote
    other = target.remote.rsplit("/device:", 1)[0]
    other_job = target.spec.job if target.spec is not None else None
    other_task = target.spec.task if target.spec is not None else None
    held = (" A ps task holds parameters: create them in this scope, but compute with them "
            "on this task." if target.ps else "")
    return (
        f"Cannot assign a device for {what}: explicit device specification '{spec}' names "
        f"{other}, another task, and this process is {_identity.prefix()}; towerflow runs "
        f"operations only in their own task's process.{held} Run this work in a process of "
        f"{other} (start it there with towerflow.Server(cluster, "
        f"{other_job or job!r}, {other_task if other_task is not None else 0})), or keep the "
        f"parameters on the ps tasks with towerflow.device(towerflow.replica_device_setter("
        f"cluster=cluster, worker_device='/job:{job}/task:{task}'))."
    )
