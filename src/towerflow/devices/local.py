"""The devices of this process: ``list_local_devices()`` and GPU visibility.

Every question about GPUs goes through one small provider, the *CUDA
runtime* (:func:`cuda_runtime`); the real one asks ``torch.cuda``. A program
that wants to describe a machine it is not running on (a test, a planner)
installs another provider with :func:`use_cuda_runtime`.

Visibility follows CUDA: ``CUDA_VISIBLE_DEVICES=2,0,3`` shows three GPUs,
renumbered so that GPU 0 is physical GPU 2 (:func:`parse_visible_devices`
reproduces CUDA's reading of the variable).

Example:
    >>> [d.name for d in list_local_devices()][:1]
    ['/device:CPU:0']
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import psutil
import torch

from towerflow.devices.settings import get_config

__all__ = [
    "LOCAL_TASK",
    "DeviceInfo",
    "GpuProperties",
    "CudaRuntime",
    "TorchCudaRuntime",
    "SimulatedCudaRuntime",
    "cuda_runtime",
    "use_cuda_runtime",
    "list_local_devices",
    "gpu_count",
    "describe_gpu",
    "parse_visible_devices",
    "full_name",
]

#: The job/replica/task prefix of this process's devices in logs and errors.
LOCAL_TASK = "/job:localhost/replica:0/task:0"


@dataclass(frozen=True, slots=True)
class GpuProperties:
    """What the CUDA runtime reports about one visible GPU."""

    name: str
    total_memory: int
    major: int
    minor: int
    pci_bus_id: str | None = None  # "0000:00:08.0"


class CudaRuntime(Protocol):
    """The questions towerflow asks the CUDA runtime (GPUs as CUDA numbers them)."""

    def device_count(self) -> int: ...

    def properties(self, index: int) -> GpuProperties: ...

    def is_initialized(self) -> bool: ...

    def set_memory_fraction(self, fraction: float, index: int) -> None: ...


class TorchCudaRuntime:
    """The real provider, backed by ``torch.cuda``.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when the driver is first asked
    anything; after the first question this provider reports itself
    initialised so that ``configure(visible_devices=...)`` can refuse a change
    that would no longer take effect.
    """

    def __init__(self) -> None:
        self._asked = False

    def device_count(self) -> int:
        if not torch.backends.cuda.is_built():
            return 0
        self._asked = True
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def properties(self, index: int) -> GpuProperties:
        props = torch.cuda.get_device_properties(index)
        return GpuProperties(
            name=props.name,
            total_memory=int(props.total_memory),
            major=int(props.major),
            minor=int(props.minor),
            pci_bus_id=_pci_bus_id(props),
        )

    def is_initialized(self) -> bool:
        return self._asked or torch.cuda.is_initialized()

    def set_memory_fraction(self, fraction: float, index: int) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, device=index)


class SimulatedCudaRuntime:
    """A machine's GPUs described in memory, numbered the way CUDA numbers them.

    It reads ``CUDA_VISIBLE_DEVICES`` (:func:`parse_visible_devices`) when first
    asked, and is initialised from then on, as the CUDA driver is. Used to
    describe a machine towerflow is not running on (tests, planning).

    Example:
        >>> gpus = [GpuProperties("NVIDIA H100 80GB HBM3", 80 << 30, 9, 0, f"0000:00:0{i}.0")
        ...         for i in range(4)]
        >>> with use_cuda_runtime(SimulatedCudaRuntime(gpus)):  # doctest: +SKIP
        ...     list_local_devices()
    """

    def __init__(self, physical: list[GpuProperties]) -> None:
        self.physical = list(physical)
        self.visible: list[int] | None = None
        self.memory_fraction: dict[int, float] = {}

    def _ordinals(self) -> list[int]:
        if self.visible is None:
            parsed = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
            everything = list(range(len(self.physical)))
            if parsed is None:
                self.visible = everything
            else:
                ordinals = [i for i in parsed if isinstance(i, int)]
                valid: list[int] = []
                for ordinal in ordinals:  # CUDA stops at the first ordinal out of range
                    if ordinal >= len(self.physical):
                        break
                    valid.append(ordinal)
                self.visible = valid
        return self.visible

    def device_count(self) -> int:
        return len(self._ordinals())

    def properties(self, index: int) -> GpuProperties:
        ordinals = self._ordinals()
        if not 0 <= index < len(ordinals):
            raise IndexError(f"GPU {index} is not visible ({len(ordinals)} visible)")
        return self.physical[ordinals[index]]

    def is_initialized(self) -> bool:
        return self.visible is not None

    def set_memory_fraction(self, fraction: float, index: int) -> None:
        self.properties(index)
        self.memory_fraction[index] = fraction


def _pci_bus_id(props: object) -> str | None:
    bus = getattr(props, "pci_bus_id", None)
    device = getattr(props, "pci_device_id", None)
    if bus is None or device is None:
        return None
    domain = getattr(props, "pci_domain_id", 0) or 0
    return f"{int(domain):04x}:{int(bus):02x}:{int(device):02x}.0"


_runtime: CudaRuntime = TorchCudaRuntime()


def cuda_runtime() -> CudaRuntime:
    """Return the provider every GPU question goes through."""
    return _runtime


@contextlib.contextmanager
def use_cuda_runtime(runtime: CudaRuntime) -> Iterator[CudaRuntime]:
    """Answer GPU questions from ``runtime`` inside the block (the previous one after).

    Example:
        >>> with use_cuda_runtime(my_runtime):  # doctest: +SKIP
        ...     list_local_devices()
    """
    global _runtime
    previous, _runtime = _runtime, runtime
    try:
        yield runtime
    finally:
        _runtime = previous


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One local device, with TensorFlow's ``device_lib`` field names.

    Attributes:
        name: ``/device:CPU:0`` or ``/device:GPU:<i>`` (``i`` as CUDA numbers it).
        device_type: ``"CPU"`` or ``"GPU"``.
        memory_limit: bytes this process may use (a GPU's total memory times
            ``gpu_memory_fraction`` when one is configured).
        physical_device_desc: for a GPU, ``device: 0, name: ..., pci bus id:
            ..., compute capability: 9.0``; empty for the CPU.
    """

    name: str
    device_type: str
    memory_limit: int
    physical_device_desc: str = ""

    @property
    def full_name(self) -> str:
        """The name with this process's task: ``/job:localhost/replica:0/task:0/device:GPU:0``."""
        return LOCAL_TASK + self.name

    def as_dict(self) -> dict[str, str | int]:
        """The four fields as a JSON-able dict."""
        return {
            "name": self.name,
            "device_type": self.device_type,
            "memory_limit": self.memory_limit,
            "physical_device_desc": self.physical_device_desc,
        }

    def __str__(self) -> str:
        lines = [
            f'name: "{self.name}"',
            f'device_type: "{self.device_type}"',
            f"memory_limit: {self.memory_limit}",
        ]
        if self.physical_device_desc:
            lines.append(f'physical_device_desc: "{self.physical_device_desc}"')
        return "\n".join(lines)


def describe_gpu(index: int, props: GpuProperties) -> str:
    """Return TensorFlow's ``physical_device_desc`` for a GPU.

    Example:
        >>> describe_gpu(0, GpuProperties("NVIDIA H100 80GB HBM3", 85 << 30, 9, 0,
        ...                               "0000:00:08.0"))
        'device: 0, name: NVIDIA H100 80GB HBM3, pci bus id: 0000:00:08.0, compute capability: 9.0'
    """
    bus = props.pci_bus_id or "unknown"
    return (
        f"device: {index}, name: {props.name}, pci bus id: {bus}, "
        f"compute capability: {props.major}.{props.minor}"
    )


def gpu_count() -> int:
    """Return the number of visible GPUs (0 without CUDA)."""
    return _runtime.device_count()


def list_local_devices() -> list[DeviceInfo]:
    """Return the CPU and every visible GPU (``device_lib.list_local_devices()``).

    The CPU's ``memory_limit`` is the machine's physical memory; a GPU's is its
    total memory, times ``gpu_memory_fraction`` when one is configured.

    Example:
        >>> list_local_devices()[0].device_type
        'CPU'
    """
    fraction = get_config().gpu_memory_fraction
    devices = [DeviceInfo("/device:CPU:0", "CPU", int(psutil.virtual_memory().total))]
    for index in range(_runtime.device_count()):
        props = _runtime.properties(index)
        limit = props.total_memory if fraction is None else int(props.total_memory * fraction)
        devices.append(
            DeviceInfo(f"/device:GPU:{index}", "GPU", limit, describe_gpu(index, props))
        )
    return devices


def full_name(device: torch.device) -> str:
    """``cpu`` -> ``/job:localhost/replica:0/task:0/device:CPU:0``; ``cuda:1`` -> ``...GPU:1``."""
    name = _FULL_NAMES.get(device)
    if name is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            name = f"{LOCAL_TASK}/device:GPU:{index}"
        elif device.type == "cpu":
            name = f"{LOCAL_TASK}/device:CPU:0"
        else:
            name = f"{LOCAL_TASK}/device:{device.type.upper()}:{device.index or 0}"
        _FULL_NAMES[device] = name
    return name


_FULL_NAMES: dict[torch.device, str] = {}


def _leading_int(text: str) -> int:
    """CUDA reads each entry like ``strtoul``: ``"1gpu"`` is 1; no digits is -1."""
    digits = ""
    for position, char in enumerate(text):
        if char.isdigit() or (position == 0 and char in "+-"):
            digits += char
        else:
            break
    try:
        return int(digits)
    except ValueError:
        return -1


def parse_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """Read a ``CUDA_VISIBLE_DEVICES`` value the way CUDA does.

    Returns ``None`` for ``None`` (the variable unset: every GPU visible), else the
    physical ordinals (or ``GPU-``/``MIG-`` UUIDs) in their new order: reading
    stops at the first invalid entry, and a repeated entry hides every GPU.

    Example:
        >>> parse_visible_devices("2,0,3"), parse_visible_devices("1,x,2")
        ([2, 0, 3], [1])
    """
    if value is None:
        return None
    entries = [entry.strip() for entry in value.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        uuids: list[str] = []
        for entry in entries:
            if entry in uuids:
                return []
            if not entry.startswith(prefix):
                break
            uuids.append(entry)
        return uuids
    ordinals: list[int] = []
    for entry in entries:
        ordinal = _leading_int(entry)
        if ordinal in ordinals:
            return []
        if ordinal < 0:
            break
        ordinals.append(ordinal)
    return ordinals
