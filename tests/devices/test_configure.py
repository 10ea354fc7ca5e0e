"""towerflow.configure: validation, context-manager restoration, visibility rules."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import towerflow
from towerflow.devices import DeviceConfig, configure, get_config, list_local_devices
from towerflow.devices.local import GpuProperties, SimulatedCudaRuntime, use_cuda_runtime
from towerflow.errors import FailedPreconditionError, InvalidArgumentError


@pytest.fixture
def no_visibility_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")


def _machine(count: int) -> SimulatedCudaRuntime:
    return SimulatedCudaRuntime(
        [GpuProperties("Tesla K20m", 5 << 30, 3, 5, f"0000:{i:02x}:00.0") for i in range(count)]
    )


def test_defaults_leave_pytorch_alone() -> None:
    assert get_config() == DeviceConfig()
    assert towerflow.configure is configure


def test_context_manager_restores_previous_settings() -> None:
    before = get_config()
    with configure(allow_soft_placement=True, default_device="cpu") as settings:
        assert settings.allow_soft_placement is True
        assert settings.default_device == "/device:CPU:0"
        assert get_config().allow_soft_placement is True
        with configure(allow_soft_placement=False):
            assert get_config().allow_soft_placement is False
            assert get_config().default_device == "/device:CPU:0"
        assert get_config().allow_soft_placement is True
    assert get_config() == before


def test_settings_are_restored_after_an_exception() -> None:
    before = get_config()
    with pytest.raises(RuntimeError, match="boom"), configure(log_device_placement=True):
        raise RuntimeError("boom")
    assert get_config() == before
    assert not logging.getLogger("towerflow.placement").handlers


def test_plain_call_applies_until_changed_back() -> None:
    settings = configure(allow_soft_placement=True)
    try:
        assert get_config().allow_soft_placement is True
        assert settings.previous.allow_soft_placement is False
    finally:
        configure(allow_soft_placement=False)
    assert get_config() == DeviceConfig()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"colour": 1}, r"configure\(\) got unknown option\(s\) colour; the options are "
                        r"visible_devices, gpu_memory_fraction"),
        ({"gpu_memory_fraction": 1.5}, r"gpu_memory_fraction=1.5 is not valid: give a number "
                                       r"in \(0, 1\]"),
        ({"gpu_memory_fraction": 0}, r"gpu_memory_fraction=0 is not valid"),
        ({"visible_devices": "2,x"}, r"visible_devices='2,x' is not valid: 'x' is neither a "
                                     r"GPU ordinal"),
        ({"visible_devices": "1,1"}, r"visible_devices='1,1' names a GPU twice"),
        ({"visible_devices": 3}, r"visible_devices=3 is not valid"),
        ({"log_device_placement": "yes"}, r"log_device_placement='yes' is not valid: give "
                                          r"True or False"),
        ({"default_device": "/gpu:x"}, r"Invalid device specification '/gpu:x'"),
    ],
)
def test_bad_options_are_rejected_and_change_nothing(options: dict, message: str) -> None:
    before = get_config()
    with pytest.raises(InvalidArgumentError, match=message):
        configure(**options)
    assert get_config() == before


def test_visible_devices_sets_and_restores_the_environment(no_visibility_env: None) -> None:
    with use_cuda_runtime(_machine(4)):
        with configure(visible_devices=[2, 0, 3]):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,0,3"
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_visible_devices_after_cuda_initialised_is_an_error(no_visibility_env: None) -> None:
    machine = _machine(4)
    with use_cuda_runtime(machine):
        with configure(visible_devices="1,0"):
            assert [d.name for d in list_local_devices()] == [
                "/device:CPU:0", "/device:GPU:0", "/device:GPU:1"]
            configure(visible_devices="1,0")  # the same set again is fine
            with pytest.raises(
                FailedPreconditionError,
                match=r"Cannot make GPUs '2' visible: CUDA was already initialised in this "
                      r"process with CUDA_VISIBLE_DEVICES='1,0'\. Call "
                      r"towerflow.configure\(visible_devices=...\) before the first CUDA",
            ):
                configure(visible_devices="2")
            assert get_config().visible_devices == "1,0"


def test_restoring_visibility_after_cuda_initialised_warns(
    no_visibility_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    with use_cuda_runtime(_machine(2)):
        with caplog.at_level(logging.WARNING, logger="towerflow.devices.config"):
            with configure(visible_devices="1"):
                assert len(list_local_devices()) == 2
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
        assert "CUDA_VISIBLE_DEVICES stays '1'" in caplog.text
        assert get_config().visible_devices is None


def test_log_placement_attaches_a_stderr_handler_only_while_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logger = logging.getLogger("towerflow.placement")
    with configure(log_device_placement=True):
        assert len(logger.handlers) == 1
        assert logger.propagate is False
        torch.ones(1).sum()
    assert logger.handlers == []
    assert logger.propagate is True
    assert "sum: (aten::sum): /job:localhost/replica:0/task:0/device:CPU:0" in \
        capsys.readouterr().err


def test_log_placement_uses_the_users_handler_when_there_is_one() -> None:
    logger = logging.getLogger("towerflow.placement")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with use_cuda_runtime(_machine(2)), configure(log_device_placement=True):
            assert logger.handlers == [handler]
    finally:
        logger.removeHandler(handler)
    assert records[:3] == [
        "Device mapping:",
        "/job:localhost/replica:0/task:0/device:GPU:0 -> device: 0, name: Tesla K20m, "
        "pci bus id: 0000:00:00.0, compute capability: 3.5",
        "/job:localhost/replica:0/task:0/device:GPU:1 -> device: 1, name: Tesla K20m, "
        "pci bus id: 0000:01:00.0, compute capability: 3.5",
    ]
