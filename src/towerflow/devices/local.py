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
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import psutil
import torch

from towerflow import _identity
from towerflow.devices.settings import get_config

__all__ = [
    "LOCAL_TASK",
    "task_prefix",
    "DeviceInfo",
    "DeviceLocality",
    "InterconnectLink",
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

#: The job/replica/task prefix of the devices of a process that is in no cluster.
LOCAL_TASK = "/job:localhost/replica:0/task:0"


def task_prefix() -> str:
    """The job/replica/task of this process's devices: its cluster task, else ``LOCAL_TASK``.

    Example:
        >>> task_prefix()  # in no cluster
        '/job:localhost/replica:0/task:0'
    """
    return _identity.prefix()


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

    def can_access_peer(self, index: int, peer: int) -> bool:
        """Whether GPU ``index`` can read GPU ``peer``'s memory directly (NVLink / PCIe P2P)."""
        return bool(torch.cuda.can_device_access_peer(index, peer))


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
class InterconnectLink:
    """A direct link from one GPU to another (TensorFlow's ``InterconnectLink``).

    Attributes:
        device_id: the peer GPU's index.
        type: the link kind (``"StreamExecutor"``: peer-to-peer access, as TF names it).
        strength: TensorFlow's link strength (1 for peer access).
    """

    device_id: int
    type: str = "StreamExecutor"
    strength: int = 1


@dataclass(frozen=True, slots=True)
class DeviceLocality:
    """Where a device sits in the machine (TensorFlow's ``DeviceLocality``).

    TensorFlow leaves a CPU's locality empty; a GPU's ``bus_id`` is its NUMA
    node plus one (1 when the machine reports none) and ``links`` lists the
    GPUs it can reach directly.

    Attributes:
        bus_id: NUMA node + 1 (0: unset, as for the CPU).
        numa_node: the NUMA node (0 when unknown).
        links: the direct links to other GPUs.
    """

    bus_id: int = 0
    numa_node: int = 0
    links: tuple[InterconnectLink, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """The fields TensorFlow prints (unset ones left out, as protobuf text does)."""
        out: dict[str, object] = {}
        if self.bus_id:
            out["bus_id"] = self.bus_id
        if self.numa_node:
            out["numa_node"] = self.numa_node
        if self.bus_id or self.links:
            out["links"] = {"link": [
                {"device_id": link.device_id, "type": link.type, "strength": link.strength}
                for link in self.links]}
        return out

    def text_lines(self) -> list[str]:
        """The ``locality { ... }`` block of TensorFlow's ``DeviceAttributes`` text."""
        lines = ["locality {"]
        if self.bus_id:
            lines.append(f"  bus_id: {self.bus_id}")
        if self.numa_node:
            lines.append(f"  numa_node: {self.numa_node}")
        if self.bus_id or self.links:
            lines.append("  links {")
            for link in self.links:
                lines += ["    link {", f"      device_id: {link.device_id}",
                          f'      type: "{link.type}"', f"      strength: {link.strength}",
                          "    }"]
            lines.append("  }")
        lines.append("}")
        return lines


_INCARNATIONS: dict[str, int] = {}


def incarnation(name: str) -> int:
    """A random non-zero 64-bit id of device ``name``, the same for the life of the process.

    TensorFlow gives each device such an id so that a peer can tell a restarted
    process's device from the one it knew.
    """
    value = _INCARNATIONS.get(name)
    if value is None:
        value = _INCARNATIONS.setdefault(name, secrets.randbits(64) or 1)
    return value


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
        locality: the device's :class:`DeviceLocality` (empty for the CPU).
        incarnation: a random 64-bit id, stable for the life of the process.
    """

    name: str
    device_type: str
    memory_limit: int
    physical_device_desc: str = ""
    locality: DeviceLocality = field(default_factory=DeviceLocality)
    incarnation: int = 0

    @property
    def full_name(self) -> str:
        """The name with this process's task: ``/job:localhost/replica:0/task:0/device:GPU:0``."""
        return task_prefix() + self.name

    def as_dict(self) -> dict[str, object]:
        """The fields as a JSON-able dict (TensorFlow's ``DeviceAttributes``)."""
        return {
            "name": self.name,
            "device_type": self.device_type,
            "memory_limit": self.memory_limit,
            "locality": self.locality.as_dict(),
            "incarnation": self.incarnation,
            "physical_device_desc": self.physical_device_desc,
        }

    def __str__(self) -> str:
        lines = [
            f'name: "{self.name}"',
            f'device_type: "{self.device_type}"',
            f"memory_limit: {self.memory_limit}",
            *self.locality.text_lines(),
            f"incarnation: {self.incarnation}",
        ]
        if self.physical_device_desc:
            lines.append(f'physical_device_desc: "{self.physical_device_desc}"')
        return "\n".join(lines)


def _numa_node(pci_bus_id: str | None) -> int:
    """The NUMA node Linux reports for a PCI device (0 when unknown, as TensorFlow reads -1)."""
    if not pci_bus_id:
        return 0
    try:
        with open(f"/sys/bus/pci/devices/{pci_bus_id.lower()}/numa_node") as handle:
            return max(int(handle.read().strip()), 0)
    except (OSError, ValueError):
        return 0


def _gpu_locality(index: int, props: GpuProperties, count: int) -> DeviceLocality:
    numa = _numa_node(props.pci_bus_id)
    peer = getattr(_runtime, "can_access_peer", None)
    links = tuple(InterconnectLink(other) for other in range(count)
                  if other != index and peer is not None and peer(index, other))
    return DeviceLocality(bus_id=numa + 1, numa_node=numa, links=links)


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
    cpu = "/device:CPU:0"
    devices = [DeviceInfo(cpu, "CPU", int(psutil.virtual_memory().total),
                          incarnation=incarnation(cpu))]
    count = _runtime.device_count()
    for index in range(count):
        props = _runtime.properties(index)
        limit = props.total_memory if fraction is None else int(props.total_memory * fraction)
        name = f"/device:GPU:{index}"
        devices.append(DeviceInfo(name, "GPU", limit, describe_gpu(index, props),
                                  _gpu_locality(index, props, count), incarnation(name)))
    return devices


def full_name(device: torch.device) -> str:
    """``cpu`` -> ``/job:localhost/replica:0/task:0/device:CPU:0``; ``cuda:1`` -> ``...GPU:1``.

    The job, replica and task are this process's (:func:`task_prefix`).
    """
    global _full_names_generation
    if _full_names_generation != _identity.generation():
        _FULL_NAMES.clear()
        _full_names_generation = _identity.generation()
    name = _FULL_NAMES.get(device)
    if name is None:
        prefix = task_prefix()
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            name = f"{prefix}/device:GPU:{index}"
        elif device.type == "cpu":
            name = f"{prefix}/device:CPU:0"
        else:
            name = f"{prefix}/device:{device.type.upper()}:{device.index or 0}"
        _FULL_NAMES[device] = name
    return name


_FULL_NAMES: dict[torch.device, str] = {}
_full_names_generation = -1


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
