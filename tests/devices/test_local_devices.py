"""list_local_devices on this machine and on a simulated multi-GPU machine."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

import towerflow
from towerflow.devices import configure, list_local_devices
from towerflow.devices.local import (
    DeviceInfo,
    DeviceLocality,
    GpuProperties,
    SimulatedCudaRuntime,
    describe_gpu,
    parse_visible_devices,
    use_cuda_runtime,
)


def _machine(count: int = 4) -> SimulatedCudaRuntime:
    gpus = [
        GpuProperties(f"NVIDIA H100 80GB HBM3 #{i}", (80 + i) << 30, 9, 0, f"0000:{i + 2:02x}:00.0")
        for i in range(count)
    ]
    return SimulatedCudaRuntime(gpus)


@pytest.fixture
def no_visibility_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # set, then delete: monkeypatch then puts back whatever the process had
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")


def test_cpu_is_listed_with_physical_memory() -> None:
    cpu = list_local_devices()[0]
    assert cpu == DeviceInfo("/device:CPU:0", "CPU", psutil.virtual_memory().total, "",
                             DeviceLocality(), cpu.incarnation)
    assert cpu.full_name == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert towerflow.list_local_devices()[0].name == "/device:CPU:0"


def test_one_entry_per_torch_visible_gpu() -> None:
    gpus = [d for d in list_local_devices() if d.device_type == "GPU"]
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert [d.name for d in gpus] == [f"/device:GPU:{i}" for i in range(expected)]


def test_gpu_description_has_tensorflow_format(no_visibility_env: None) -> None:
    with use_cuda_runtime(_machine(2)):
        gpu = list_local_devices()[2]
    assert gpu.name == "/device:GPU:1"
    assert gpu.device_type == "GPU"
    assert gpu.memory_limit == 81 << 30
    assert gpu.physical_device_desc == (
        "device: 1, name: NVIDIA H100 80GB HBM3 #1, pci bus id: 0000:03:00.0, "
        "compute capability: 9.0"
    )
    assert gpu.locality == DeviceLocality(bus_id=1)
    assert str(gpu).splitlines() == [
        'name: "/device:GPU:1"',
        'device_type: "GPU"',
        f"memory_limit: {81 << 30}",
        "locality {",
        "  bus_id: 1",
        "  links {",
        "  }",
        "}",
        f"incarnation: {gpu.incarnation}",
        'physical_device_desc: "device: 1, name: NVIDIA H100 80GB HBM3 #1, pci bus id: '
        '0000:03:00.0, compute capability: 9.0"',
    ]
    assert gpu.as_dict()["physical_device_desc"] == gpu.physical_device_desc


def test_missing_pci_bus_id_is_reported_as_unknown() -> None:
    props = GpuProperties("Tesla K40c", 12 << 30, 3, 5, None)
    assert describe_gpu(0, props) == (
        "device: 0, name: Tesla K40c, pci bus id: unknown, compute capability: 3.5"
    )


def test_cuda_visible_devices_env_hides_and_renumbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,3")
    with use_cuda_runtime(_machine(4)):
        gpus = list_local_devices()[1:]
    assert [g.name for g in gpus] == ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]
    assert [g.physical_device_desc.split(", ")[1] for g in gpus] == [
        "name: NVIDIA H100 80GB HBM3 #2", "name: NVIDIA H100 80GB HBM3 #0",
        "name: NVIDIA H100 80GB HBM3 #3"]
    assert gpus[0].physical_device_desc.startswith("device: 0, ")
    assert "pci bus id: 0000:04:00.0" in gpus[0].physical_device_desc


def test_configure_visible_devices_renumbers(no_visibility_env: None) -> None:
    machine = _machine(4)
    with use_cuda_runtime(machine), configure(visible_devices="2,0"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,0"
        gpus = list_local_devices()[1:]
        assert [g.physical_device_desc for g in gpus] == [
            "device: 0, name: NVIDIA H100 80GB HBM3 #2, pci bus id: 0000:04:00.0, "
            "compute capability: 9.0",
            "device: 1, name: NVIDIA H100 80GB HBM3 #0, pci bus id: 0000:02:00.0, "
            "compute capability: 9.0",
        ]


def test_memory_fraction_caps_memory_limit_and_each_gpu(no_visibility_env: None) -> None:
    machine = _machine(2)
    with use_cuda_runtime(machine):
        with configure(gpu_memory_fraction=0.7):
            limits = [d.memory_limit for d in list_local_devices()[1:]]
            assert machine.memory_fraction == {0: 0.7, 1: 0.7}
        assert limits == [int((80 << 30) * 0.7), int((81 << 30) * 0.7)]
        assert machine.memory_fraction == {0: 1.0, 1: 1.0}
        assert list_local_devices()[1].memory_limit == 80 << 30


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("2,0,3", [2, 0, 3]),
        ("1", [1]),
        ("", []),
        ("1,x,2", [1]),
        ("0,2,-1,1", [0, 2]),
        ("1,1", []),
        ("1gpu,2", [1, 2]),
        ("GPU-aaa,GPU-bbb", ["GPU-aaa", "GPU-bbb"]),
    ],
)
def test_parse_visible_devices_reads_like_cuda(
    value: str | None, expected: list[int] | None, no_visibility_env: None
) -> None:
    assert parse_visible_devices(value) == expected


@pytest.mark.gpu
def test_real_gpu_description_matches_torch() -> None:
    gpu = list_local_devices()[1]
    props = torch.cuda.get_device_properties(0)
    assert gpu.physical_device_desc.startswith(f"device: 0, name: {props.name}, pci bus id: ")
    assert gpu.physical_device_desc.endswith(
        f", compute capability: {props.major}.{props.minor}")
    assert gpu.memory_limit == props.total_memory


@pytest.mark.gpu
def test_real_memory_fraction_caps_allocations() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    with configure(gpu_memory_fraction=0.25):
        assert list_local_devices()[1].memory_limit == int(total * 0.25)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.4), dtype=torch.uint8, device="cuda:0")
    small = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda:0")
    assert small.numel() == int(total * 0.3)
    del small
    torch.cuda.empty_cache()


def test_devices_carry_tensorflows_incarnation_and_locality() -> None:
    cpu = list_local_devices()[0]
    assert 0 < cpu.incarnation < 1 << 64
    assert list_local_devices()[0].incarnation == cpu.incarnation  # stable in the process
    assert cpu.locality == DeviceLocality()  # TensorFlow leaves the CPU's locality empty
    assert str(cpu).splitlines()[3:] == ["locality {", "}", f"incarnation: {cpu.incarnation}"]
    assert cpu.as_dict() == {
        "name": "/device:CPU:0", "device_type": "CPU", "memory_limit": cpu.memory_limit,
        "locality": {}, "incarnation": cpu.incarnation, "physical_device_desc": "",
    }
    with use_cuda_runtime(_machine(2)):
        gpus = list_local_devices()[1:]
    assert len({cpu.incarnation, *(g.incarnation for g in gpus)}) == 3
    assert gpus[0].as_dict()["locality"] == {"bus_id": 1, "links": {"link": []}}


def test_incarnation_differs_between_processes(python: str,
                                               subprocess_env: dict[str, str]) -> None:
    import subprocess

    from towerflow import list_local_devices

    code = "import towerflow; print(towerflow.list_local_devices()[0].incarnation)"
    child = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                           env=subprocess_env, timeout=120).stdout.strip()
    mine = list_local_devices()[0].incarnation
    assert child.isdigit() and int(child) != mine  # this process and another one
    assert list_local_devices()[0].incarnation == mine  # fixed for a process's life
