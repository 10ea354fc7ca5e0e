"""towerflow.save / towerflow.load: device-agnostic, verified, never pickled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import towerflow
from towerflow.checkpoint import CheckpointManager, load, save
from towerflow.errors import DataLossError, InvalidArgumentError, NotFoundError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))


def _small(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_save_writes_safetensors_and_manifest(tmp_path: Path) -> None:
    path = save(_small(0), tmp_path / "m", metadata={"note": "x"})
    assert sorted(os.listdir(path)) == ["manifest.json", "manifest.sha256", "model.safetensors"]


def test_load_into_a_fresh_model_reproduces_its_outputs(tmp_path: Path) -> None:
    src, dst = _small(0), _small(1)
    x = torch.randn(5, 4)
    save(src, tmp_path / "m")
    tensors = load(tmp_path / "m", device="cpu", into=dst)
    assert set(tensors) == set(src.state_dict())
    assert torch.equal(dst(x), src(x))


def test_public_names_save_and_load_a_state_dict(tmp_path: Path) -> None:
    state = {"w": torch.arange(4, dtype=torch.int32), "h": torch.ones(2, dtype=torch.float16)}
    towerflow.save(state, tmp_path / "s")
    back = towerflow.load(tmp_path / "s")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)


def test_load_refuses_a_different_model_listing_the_differences(tmp_path: Path) -> None:
    save(_small(0), tmp_path / "m")
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2), nn.Linear(2, 2))
    with pytest.raises(InvalidArgumentError) as info:
        load(tmp_path / "m", into=other)
    message = str(info.value)
    assert "shape of 0.weight: checkpoint [3, 4], module [5, 4]" in message
    assert "missing from the checkpoint: 3.weight, 3.bias" in message


def test_saving_again_replaces_the_saved_model(tmp_path: Path) -> None:
    save(_small(0), tmp_path / "m")
    second = _small(2)
    save(second, tmp_path / "m")
    loaded = load(tmp_path / "m")
    assert torch.equal(loaded["0.weight"], second.state_dict()["0.weight"])
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_save_refuses_to_overwrite_something_else(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(InvalidArgumentError, match=r"Refusing to overwrite .*notes"):
        save(_small(0), tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(InvalidArgumentError, match=r"expects an nn.Module or a mapping"):
        save([torch.ones(1)], tmp_path / "list")  # type: ignore[arg-type]


def test_load_of_nothing_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=r"No checkpoint found at .*absent"):
        load(tmp_path / "absent")


def test_load_of_a_corrupt_save_names_the_file(tmp_path: Path) -> None:
    path = save(_small(0), tmp_path / "m")
    fpath = path / "model.safetensors"
    data = bytearray(fpath.read_bytes())
    data[-1] ^= 1
    fpath.write_bytes(bytes(data))
    with pytest.raises(DataLossError, match=r"m/model\.safetensors.*checksum"):
        load(path)


def test_load_from_a_train_dir_reads_its_latest_model(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(1, {"model": {"w": torch.zeros(2)}})
    mgr.save(2, {"model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}})
    assert torch.equal(load(tmp_path / "run")["w"], torch.ones(2))
    mgr.save(3, {"ema": {"w": torch.ones(2)}})
    with pytest.raises(NotFoundError, match=r"has no 'model' group \(it has \['ema'\]\)"):
        load(tmp_path / "run")


def test_load_takes_torch_devices_and_says_how_to_pass_a_tf_style_name(tmp_path: Path) -> None:
    save(_small(0), tmp_path / "m")
    for device in ("cpu", "cpu:0", torch.device("cpu"), towerflow.resolve_device("/cpu:0"), None):
        tensors = load(tmp_path / "m", device=device)
        assert all(t.device.type == "cpu" for t in tensors.values())
    with pytest.raises(InvalidArgumentError, match=r"resolve_device\('/cpu:0'\) gives one"):
        load(tmp_path / "m", device="/cpu:0")


@pytest.mark.gpu
def test_saved_on_gpu_loads_on_cpu_and_back(tmp_path: Path) -> None:
    model = _model(0).to("cuda:0")
    model(torch.randn(2, 3, 6, 6, device="cuda:0"))  # materialise the lazy layer
    save(model, tmp_path / "gpu")
    on_cpu = load(tmp_path / "gpu", device="cpu")
    assert all(t.device.type == "cpu" for t in on_cpu.values())
    cpu_model = _model(1)
    cpu_model(torch.randn(2, 3, 6, 6))
    load(tmp_path / "gpu", device="cpu", into=cpu_model)
    save(cpu_model, tmp_path / "cpu")
    on_gpu = load(tmp_path / "cpu", device=towerflow.resolve_device("/gpu:0"))
    assert all(t.device == torch.device("cuda:0") for t in on_gpu.values())
    for name, value in model.state_dict().items():
        assert torch.equal(on_gpu[name], value), name
