"""The process-wide device settings (the value only; ``configure`` applies them).

Kept apart from :mod:`towerflow.devices.config` so that the device list and
the placer can read the settings without importing the code that changes them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["DeviceConfig", "get_config"]


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """The device settings in force (TensorFlow's ``ConfigProto`` device options).

    Attributes:
        visible_devices: the GPUs made visible by ``configure`` (``"2,0"``) or
            ``None`` when ``CUDA_VISIBLE_DEVICES`` is left as the process found it.
        gpu_memory_fraction: cap on each visible GPU's memory for this process
            (``per_process_gpu_memory_fraction``), ``None`` for no cap.
        default_device: where operations outside any scope run: ``None``
            (PyTorch's own rule: where their inputs are, factories on the CPU),
            ``"auto"`` (the lowest-numbered visible GPU when there is one, as
            TensorFlow does), ``"cpu"`` or any device string.
        log_device_placement: log the device of every operation.
        allow_soft_placement: run an operation whose device does not exist, or
            has no kernel for it, on the CPU instead of raising ``PlacementError``.
    """

    visible_devices: str | None = None
    gpu_memory_fraction: float | None = None
    default_device: str | None = None
    log_device_placement: bool = False
    allow_soft_placement: bool = False


_lock = threading.RLock()
_current = DeviceConfig()
# bumped on every change, so per-thread caches (the placer's target) know to refresh
_generation = 0


def get_config() -> DeviceConfig:
    """Return the device settings in force.

    Example:
        >>> get_config().allow_soft_placement
        False
    """
    return _current


def generation() -> int:
    """Return a counter that changes whenever the settings change."""
    return _generation


def set_config(config: DeviceConfig) -> None:
    """Replace the settings value (``configure`` does the side effects first)."""
    global _current, _generation
    with _lock:
        _current = config
        _generation += 1


def lock() -> threading.RLock:
    """The lock ``configure`` holds while it changes the settings."""
    return _lock
