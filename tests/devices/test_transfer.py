"""Batches follow the model (``towerflow.devices.transfer``).

The model computes on a device other than the CPU the batches come from:
PyTorch's ``lazy`` device stands in for a GPU on a machine without one (tensors
on it and on the CPU do not mix, as on a GPU). Each strategy's ``run_step``
moves what it is given, nested as a program nests it; a table's ids are read
from the batch's host copy, never back from the device.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from test_placement import collect_placement_log
from torch import nn
from torch.overrides import TorchFunctionMode

from towerflow.devices import DEVICE_ENV, compute_device, move_to_device
from towerflow.errors import InvalidArgumentError
from towerflow.strategies import OptimizerConfig, SingleDevice


class Pair(NamedTuple):
    ids: torch.Tensor
    label: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Example:
    dense: torch.Tensor
    name: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_nested_batches_move_with_their_types_and_dtypes(second_device) -> None:
    counts = collections.defaultdict(int, {"n": torch.ones(2, dtype=torch.int32)})
    batch = {
        "pair": Pair(torch.arange(3), torch.ones(3, dtype=torch.float64)),
        "list": [torch.zeros(2, dtype=torch.bfloat16), "keep", 7, None],
        "example": Example(torch.ones(2, 2), "a", {"w": torch.ones(1, dtype=torch.int8)}),
        "ordered": collections.OrderedDict([("b", torch.ones(1)), ("a", torch.ones(1))]),
        "counts": counts,
    }
    moved = move_to_device(batch, second_device)
    assert type(moved["pair"]) is Pair and moved["pair"].ids.device.type == "lazy"
    assert moved["pair"].label.dtype == torch.float64
    assert moved["list"][0].device.type == "lazy" and moved["list"][0].dtype == torch.bfloat16
    assert moved["list"][1:] == ["keep", 7, None]
    assert type(moved["example"]) is Example and moved["example"].name == "a"
    assert moved["example"].dense.device.type == "lazy"
    assert moved["example"].extra["w"].dtype == torch.int8
    assert list(moved["ordered"]) == ["b", "a"]
    assert isinstance(moved["counts"], collections.defaultdict)
    assert moved["counts"]["missing"] == 0  # the factory kept
    # the program's own batch is left as it was
    assert batch["pair"].ids.device.type == "cpu" and batch["example"].dense.device.type == "cpu"
    torch.testing.assert_close(moved["pair"].ids.cpu(), torch.arange(3))


def test_a_batch_already_on_the_device_is_not_copied(second_device) -> None:
    on_cpu = {"x": [torch.ones(2)], "y": (torch.zeros(1), "label")}
    assert move_to_device(on_cpu, torch.device("cpu")) is on_cpu
    there = torch.ones(2).to(second_device)
    mixed = (there, torch.ones(1))
    moved = move_to_device(mixed, second_device)
    assert moved[0] is there and moved[1].device.type == "lazy"


class _Copies(TorchFunctionMode):
    """Records each ``Tensor.to`` call: (source device, dtype, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.device, torch.dtype, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to or getattr(func, "__name__", "") in ("to", "cpu"):
            self.calls.append((args[0].device, args[0].dtype, bool(kwargs.get("non_blocking"))))
        return func(*args, **kwargs)


def test_an_unpinned_batch_is_copied_blocking_and_twins_name_the_host_copies(
        second_device) -> None:
    ids, dense = torch.arange(4), torch.ones(4)
    twins: dict[int, torch.Tensor] = {}
    with _Copies() as copies:
        moved = move_to_device((ids, dense), second_device, twins)
    assert [non_blocking for _, _, non_blocking in copies.calls] == [False, False]
    assert twins == {id(moved[0]): ids, id(moved[1]): dense}


@pytest.fixture
def placement_log() -> Iterator[list[str]]:
    yield from collect_placement_log()


def test_the_placement_log_shows_each_copy_as_a_transfer(second_device,
                                                         placement_log: list[str]) -> None:
    batch = {"ids": torch.arange(2), "label": torch.ones(2)}
    del placement_log[:]
    move_to_device(batch, second_device)
    move_to_device(batch, torch.device("cpu"))  # nothing to copy: no line
    lines = [line for line in placement_log if "_to_device" in line]
    cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    assert lines == [f"batch/ids/_to_device: (aten::_to_copy): "
                     f"/job:localhost/replica:0/task:0/device:LAZY:0 (copied from {cpu})",
                     f"batch/label/_to_device: (aten::_to_copy): "
                     f"/job:localhost/replica:0/task:0/device:LAZY:0 (copied from {cpu})"]


def test_compute_device_takes_the_argument_then_the_environment() -> None:
    assert compute_device("cpu", env={DEVICE_ENV: "lazy"}) == torch.device("cpu")
    assert compute_device(env={DEVICE_ENV: "lazy"}) == torch.device("lazy")
    assert compute_device(env={DEVICE_ENV: "/cpu:0"}) == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert compute_device(env={}) == expected  # GPU first, else the CPU
    with pytest.raises(InvalidArgumentError, match=r"TOWERFLOW_DEVICE='/gpu:x' names no "
                                                   r"device.*set it to 'cpu'"):
        compute_device(env={DEVICE_ENV: "/gpu:x"})


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    assert batch["x"].device == next(model.parameters()).device, "the batch was not moved"
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def test_single_device_moves_the_batch_to_the_model(second_device) -> None:
    torch.manual_seed(0)
    model, reference = nn.Linear(3, 1), nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    strategy = SingleDevice(second_device)
    strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        batch = {"x": torch.randn(8, 3), "y": torch.randn(8, 1)}
        loss = strategy.run_step(_mse, batch).loss
        optimizer.zero_grad()
        expected = nn.functional.mse_loss(reference(batch["x"]), batch["y"])
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss.cpu(), expected.detach())
    torch.testing.assert_close(model.weight.cpu(), reference.weight.detach())


def test_a_supervisor_loop_feeds_cpu_batches_to_a_model_elsewhere(second_device, tmp_path,
                                                                  monkeypatch) -> None:
    from towerflow.training import Supervisor

    monkeypatch.setenv(DEVICE_ENV, "lazy")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    sv = Supervisor(logdir=None, is_chief=True)
    with sv.managed_session(model=model) as sess:
        assert sess.strategy.device.type == "lazy"
        for _ in range(4):
            result = sess.run_step(_mse, {"x": torch.randn(8, 3), "y": torch.randn(8, 1)})
    assert result.global_step == 4 and model.weight.device.type == "lazy"
