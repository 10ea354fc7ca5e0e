"""flatten_state / unflatten_state and load_into_module."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from towerflow.checkpoint import (
    CheckpointManager,
    flatten_state,
    load_into_module,
    unflatten_state,
)
from towerflow.errors import DataLossError, InvalidArgumentError


def test_round_trip_keeps_key_types_tuples_and_special_floats() -> None:
    state = {
        "state": {0: {"buf": torch.ones(2)}, 1: {}},
        "groups": [{"params": [0, 1], "betas": (0.9, 0.999), "foreach": None, "amsgrad": False}],
        "__weird__": "kept",
        "floats": [math.inf, -math.inf, 0.1],
        "name": "sgd",
    }
    tensors, meta = flatten_state(state)
    assert set(tensors) == {"state.0.buf"}
    json.dumps(meta, allow_nan=False)  # strict JSON, storable in a manifest
    back = unflatten_state(tensors, json.loads(json.dumps(meta)))
    assert list(back["state"]) == [0, 1]
    assert back["groups"][0]["betas"] == (0.9, 0.999)
    assert back["floats"][:2] == [math.inf, -math.inf]
    assert back["__weird__"] == "kept"
    assert back["state"][0]["buf"] is tensors["state.0.buf"]


def test_nan_survives_the_round_trip() -> None:
    tensors, meta = flatten_state({"x": float("nan")})
    assert math.isnan(unflatten_state(tensors, json.loads(json.dumps(meta)))["x"])


def test_prefix_is_prepended_to_tensor_names() -> None:
    tensors, meta = flatten_state({"state": {3: {"exp_avg": torch.zeros(1)}}}, prefix="opt/")
    assert list(tensors) == ["opt/state.3.exp_avg"]
    assert torch.equal(unflatten_state(tensors, meta)["state"][3]["exp_avg"], torch.zeros(1))


def test_colliding_paths_get_distinct_names() -> None:
    tensors, meta = flatten_state({"a": {1: torch.ones(1), "1": torch.zeros(1)}})
    assert len(tensors) == 2
    back = unflatten_state(tensors, meta)
    assert torch.equal(back["a"][1], torch.ones(1)) and torch.equal(back["a"]["1"], torch.zeros(1))


def test_unsupported_values_and_keys_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'opt\.fn' is a function"):
        flatten_state({"opt": {"fn": lambda: 0}})
    with pytest.raises(InvalidArgumentError, match=r"key 1.5 of type float"):
        flatten_state({"s": {1.5: 0}})


def test_bad_descriptions_are_data_loss() -> None:
    with pytest.raises(DataLossError, match=r"not in the 'towerflow.state/1' format"):
        unflatten_state({}, {"tree": {}})
    _, meta = flatten_state({"w": torch.ones(1)})
    with pytest.raises(DataLossError, match=r"refers to tensor 'w'"):
        unflatten_state({}, meta)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.99), amsgrad=True)


def _adagrad(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=gen)
        y = torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("make_opt", [_sgd, _adam, _adagrad], ids=["sgd", "adam", "adagrad"])
def test_restored_optimizer_continues_identically(
    tmp_path: Path, make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    ref_opt = make_opt(list(ref.parameters()))
    _train(ref, ref_opt, range(3))

    opt_tensors, opt_meta = flatten_state(ref_opt.state_dict())
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"model": ref.state_dict(), "optimizer": opt_tensors}, {"optimizer": opt_meta})

    restored = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    restored_opt = make_opt(list(restored.parameters()))
    ckpt = mgr.restore()
    assert ckpt is not None
    load_into_module(restored, ckpt.groups["model"])
    restored_opt.load_state_dict(unflatten_state(ckpt.groups["optimizer"], ckpt.metadata["optimizer"]))

    _train(ref, ref_opt, range(3, 6))
    _train(restored, restored_opt, range(3, 6))
    for a, b in zip(ref.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)


class _Net(nn.Module):
    def __init__(self, hidden: int = 3, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc = nn.Linear(4, hidden, dtype=dtype)
        self.norm = nn.BatchNorm1d(hidden, dtype=dtype)


def test_load_into_module_copies_parameters_and_buffers() -> None:
    src, dst = _Net(), _Net()
    src.norm.running_mean.fill_(2.0)
    load_into_module(dst, src.state_dict())
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_mismatch_lists_every_difference_and_changes_nothing() -> None:
    dst = _Net()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    tensors = dict(_Net(hidden=5).state_dict())
    tensors["fc.bias"] = tensors["fc.bias"][:3].double()
    del tensors["norm.num_batches_tracked"]
    tensors["extra.weight"] = torch.ones(1)
    with pytest.raises(InvalidArgumentError) as info:
        load_into_module(dst, tensors)
    msg = str(info.value)
    assert re.search(r"missing from the checkpoint: norm\.num_batches_tracked", msg)
    assert re.search(r"not in the module: extra\.weight", msg)
    assert re.search(r"shape of fc\.weight: checkpoint \[5, 4\], module \[3, 4\]", msg)
    assert re.search(r"dtype of fc\.bias: checkpoint float64, module float32", msg)
    assert re.search(r"shape of norm\.running_mean: checkpoint \[5\], module \[3\]", msg)
    for name, value in dst.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_non_strict_skips_one_sided_names_but_not_shapes() -> None:
    dst = _Net()
    partial = {"fc.weight": torch.zeros(3, 4), "other": torch.ones(1)}
    load_into_module(dst, partial, strict=False)
    assert torch.equal(dst.fc.weight, torch.zeros(3, 4))
    with pytest.raises(InvalidArgumentError, match=r"shape of fc\.weight: checkpoint \[2, 4\]"):
        load_into_module(dst, {"fc.weight": torch.zeros(2, 4)}, strict=False)

