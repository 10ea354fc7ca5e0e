"""The device model: device names, the local devices, settings and op placement.

Example:
    >>> import torch, towerflow
    >>> towerflow.DeviceSpec.from_string("/gpu:0").to_string()
    '/device:GPU:0'
    >>> with towerflow.device("/cpu:0"):
    ...     torch.zeros(2).device
    device(type='cpu')
"""

from __future__ import annotations

from towerflow.devices.config import DeviceSettings, configure
from towerflow.devices.functions import Operation
from towerflow.devices.local import DeviceInfo, DeviceLocality, list_local_devices
from towerflow.devices.params import ParameterPlacement, parameter_placements
from towerflow.devices.placer import current_scope, device, resolve_device
from towerflow.devices.settings import DeviceConfig, get_config
from towerflow.devices.spec import DeviceSpec
from towerflow.devices.transfer import DEVICE_ENV, compute_device, move_to_device

__all__ = [
    "DeviceSpec",
    "DeviceInfo",
    "DeviceLocality",
    "DeviceConfig",
    "Operation",
    "ParameterPlacement",
    "parameter_placements",
    "DeviceSettings",
    "list_local_devices",
    "device",
    "configure",
    "resolve_device",
    "get_config",
    "current_scope",
    "compute_device",
    "move_to_device",
    "DEVICE_ENV",
]
