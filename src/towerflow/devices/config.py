"""``towerflow.configure``: TensorFlow's ``ConfigProto`` device options for a process.

::

    towerflow.configure(visible_devices="2,0", gpu_memory_fraction=0.7,
                        log_device_placement=True, allow_soft_placement=True)

    with towerflow.configure(allow_soft_placement=True):   # restored on exit
        ...

Options left out keep their value. ``visible_devices`` sets
``CUDA_VISIBLE_DEVICES`` (GPU 0 becomes the first one listed); it must happen
before CUDA is first used in the process, as with the variable itself.
``gpu_memory_fraction`` caps each visible GPU with
``torch.cuda.set_per_process_memory_fraction`` (this initialises CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from towerflow.devices import log as _log
from towerflow.devices import placer as _placer
from towerflow.devices import settings as _settings
from towerflow.devices.local import cuda_runtime, parse_visible_devices
from towerflow.devices.settings import DeviceConfig, get_config
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["configure", "DeviceSettings", "DeviceConfig", "get_config"]

_logger = logging.getLogger(__name__)
_OPTIONS = tuple(field.name for field in dataclasses.fields(DeviceConfig))
# CUDA_VISIBLE_DEVICES as it was before configure took visibility over
_original_visible: str | None = None


class DeviceSettings:
    """The settings a :func:`configure` call put in force; a context manager.

    Used in a ``with`` statement, it restores the settings that were in force
    before the call when the block ends (also on an exception).

    Attributes:
        config: the :class:`DeviceConfig` now in force.
        previous: the :class:`DeviceConfig` the call replaced.
    """

    __slots__ = ("config", "previous")

    def __init__(self, config: DeviceConfig, previous: DeviceConfig) -> None:
        self.config = config
        self.previous = previous

    def __getattr__(self, name: str) -> Any:
        if name in _OPTIONS:
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> DeviceSettings:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _settings.lock():
            _apply(get_config(), self.previous, restoring=True)

    def __repr__(self) -> str:
        return f"DeviceSettings({self.config!r})"


def configure(**options: Any) -> DeviceSettings:
    """Change the device settings of this process; returns them as a context manager.

    Args:
        visible_devices: GPUs to show, in order (``"2,0"``, ``[2, 0]``, ``""``
            for none), as ``CUDA_VISIBLE_DEVICES``; ``None`` restores the
            variable as the process found it.
        gpu_memory_fraction: fraction in ``(0, 1]`` of each GPU's memory this
            process may allocate; ``None`` for no cap.
        default_device: ``None``, ``"auto"`` (lowest-numbered visible GPU),
            ``"cpu"`` or a device string, for operations outside any scope.
        log_device_placement: log each operation's device (logger
            ``towerflow.placement``, shown on stderr).
        allow_soft_placement: fall back to the CPU instead of raising
            ``PlacementError``.

    Raises:
        InvalidArgumentError: an unknown option or a bad value.
        FailedPreconditionError: ``visible_devices`` changes after CUDA was initialised.

    Example:
        >>> with configure(allow_soft_placement=True) as settings:
        ...     settings.allow_soft_placement
        True
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"configure() got unknown option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(_OPTIONS)}."
        )
    validated = {name: _VALIDATORS[name](value) for name, value in options.items()}
    with _settings.lock():
        previous = get_config()
        new = dataclasses.replace(previous, **validated)
        _placer.check_default_device(new)
        _apply(previous, new)
        return DeviceSettings(new, previous)


def _apply(old: DeviceConfig, new: DeviceConfig, *, restoring: bool = False) -> None:
    """Make ``new`` the settings in force, doing each change's side effect."""
    if new.visible_devices != old.visible_devices:
        _set_visible_devices(old.visible_devices, new.visible_devices, restoring)
    _settings.set_config(new)
    if new.gpu_memory_fraction != old.gpu_memory_fraction:
        _set_memory_fraction(new.gpu_memory_fraction)
    if new.log_device_placement != old.log_device_placement:
        _log.set_enabled(new.log_device_placement)
    _placer.refresh_global()


def _set_visible_devices(old: str | None, value: str | None, restoring: bool) -> None:
    global _original_visible
    if old is None:
        _original_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = _original_visible if value is None else value
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parse_visible_devices(wanted) == parse_visible_devices(current):
        return
    if cuda_runtime().is_initialized():
        if restoring:  # CUDA keeps the GPUs it was initialised with; say so, do not fail
            _logger.warning(
                "CUDA_VISIBLE_DEVICES stays %r: CUDA was initialised while it was in force",
                current,
            )
            return
        shown = "all GPUs" if current is None else f"CUDA_VISIBLE_DEVICES={current!r}"
        raise FailedPreconditionError(
            f"Cannot make GPUs {wanted!r} visible: CUDA was already initialised in this "
            f"process with {shown}. Call towerflow.configure(visible_devices=...) before the "
            f"first CUDA operation, or set CUDA_VISIBLE_DEVICES before starting Python."
        )
    if wanted is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = wanted


def _set_memory_fraction(fraction: float | None) -> None:
    runtime = cuda_runtime()
    count = runtime.device_count()
    for index in range(count):
        runtime.set_memory_fraction(1.0 if fraction is None else fraction, index)
    if count:
        _logger.debug("GPU memory fraction %s set on %d GPU(s)", fraction, count)


# ---------------------------------------------------------------- validation
def _visible_devices(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        value = ",".join(str(item) for item in value)
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"visible_devices={value!r} is not valid: give GPU ordinals as a string "
            f"such as '2,0' or a list such as [2, 0] ('' hides every GPU)."
        )
    entries = [entry.strip() for entry in value.split(",")] if value.strip() else []
    for entry in entries:
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            raise InvalidArgumentError(
                f"visible_devices={value!r} is not valid: {entry!r} is neither a GPU ordinal "
                f"nor a GPU-/MIG- UUID; give e.g. '2,0'."
            )
    if len(set(entries)) != len(entries):
        raise InvalidArgumentError(
            f"visible_devices={value!r} names a GPU twice; CUDA would then hide every GPU. "
            f"Name each GPU once, e.g. '2,0'."
        )
    return ",".join(entries)


def _memory_fraction(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidArgumentError(
            f"gpu_memory_fraction={value!r} is not valid: give a number in (0, 1], "
            f"e.g. 0.7 for 70% of each GPU's memory, or None for no cap."
        )
    return float(value)


def _default_device(value: Any) -> str | None:
    if value is None or value == "auto":
        return value
    return DeviceSpec.from_string(value).to_string()


def _flag(name: str) -> Any:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name}={value!r} is not valid: give True or False.")
        return value

    return check


_VALIDATORS = {
    "visible_devices": _visible_devices,
    "gpu_memory_fraction": _memory_fraction,
    "default_device": _default_device,
    "log_device_placement": _flag("log_device_placement"),
    "allow_soft_placement": _flag("allow_soft_placement"),
}
