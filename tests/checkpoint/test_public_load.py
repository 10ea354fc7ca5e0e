"""towerflow.load takes the device model's names; the checkpoint leaf takes torch's only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import towerflow
from towerflow.checkpoint import load as leaf_load
from towerflow.errors import InvalidArgumentError, PlacementError


def test_public_load_takes_tensorflow_device_names(tmp_path: Path) -> None:
    towerflow.save({"w": torch.arange(3.0)}, tmp_path / "m")
    for name in ("/cpu:0", "/device:CPU:0", "cpu", towerflow.DeviceSpec.from_string("/cpu:0")):
        tensors = towerflow.load(tmp_path / "m", device=name)
        assert torch.equal(tensors["w"], torch.arange(3.0)) and tensors["w"].device.type == "cpu"
    with pytest.raises(InvalidArgumentError, match=r"resolve_device"):
        leaf_load(tmp_path / "m", device="/cpu:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_public_load_refuses_a_device_this_process_lacks(tmp_path: Path) -> None:
    towerflow.save({"w": torch.ones(1)}, tmp_path / "m")
    with pytest.raises(PlacementError, match=r"'/device:GPU:0'.*available devices: .*CPU:0"):
        towerflow.load(tmp_path / "m", device="/gpu:0")
