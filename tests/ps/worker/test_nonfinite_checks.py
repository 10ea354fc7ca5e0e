"""The worker's check of a step's gradients before they are pushed: one reduction, and
finite values whose sum overflows are not taken for NaN / inf."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towerflow.ps.placement import plan_placement
from towerflow.ps.worker.dense.variables import FlatBuffers
from towerflow.ps.worker.tables.sparse_tables import SparseTables


def _buffers(values: dict[str, torch.Tensor]) -> FlatBuffers:
    params = {name: nn.Parameter(torch.zeros_like(v)) for name, v in values.items()}
    buffers = FlatBuffers(plan_placement(params, 2), params, torch.device("cpu"))
    for name, value in values.items():
        params[name].grad.copy_(value)
    return buffers


def test_finite_gradients_whose_sum_overflows_are_pushed() -> None:
    big = torch.full((4,), 3e38)  # finite float32 values; their sum is inf
    assert not torch.isfinite(big.sum())
    assert _buffers({"a": big, "b": big.clone()}).nonfinite_gradient() is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_gradient_is_named(bad: float) -> None:
    grad = torch.ones(6)
    grad[3] = bad
    buffers = _buffers({"a": torch.ones(5), "b": grad})
    assert buffers.nonfinite_gradient() == "b"


class _Table:
    def __init__(self, name: str) -> None:
        self.config = type("Config", (), {"name": name})()


def test_tables_check_all_rows_at_once_and_name_the_bad_table() -> None:
    big = torch.full((2, 3), 3e38)
    taken = [(_Table("a"), torch.tensor([0, 1]), big), (_Table("b"), torch.tensor([4]),
                                                        torch.ones(1, 3))]
    assert SparseTables.nonfinite(taken) is None  # finite; only the sums overflow
    taken.append((_Table("c"), torch.tensor([2]), torch.tensor([[1.0, float("nan"), 0.0]])))
    assert SparseTables.nonfinite(taken) == "c (sparse table)"
    assert SparseTables.nonfinite([(_Table("e"), torch.empty(0, dtype=torch.int64),
                                    torch.empty(0, 3))]) is None
