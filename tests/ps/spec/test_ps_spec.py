"""The spec room: one list of every name users and both ps halves say, and what reads it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import towerflow.cli as cli
from towerflow.errors import InvalidArgumentError
from towerflow.ps import spec
from towerflow.ps.spec.dense import OPTIMIZER_NAMES, SLOT_NAMES, torch_optimizer_class
from towerflow.ps.spec.row_optimizers import (
    ROW_COUNTERPARTS,
    SPARSE_OPTIMIZERS,
    sparse_optimizer_for,
)
from towerflow.strategies import OptimizerConfig
from towerflow.training.names import TASK_NAMES
from towerflow.training.tasks import TASKS


def _commands(parser):  # type: ignore[no-untyped-def]
    """The sub-command parsers of ``towerflow``'s parser, by name."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_dense_optimizer_has_slots_a_torch_twin_and_a_row_counterpart() -> None:
    assert set(SLOT_NAMES) == set(OPTIMIZER_NAMES) == set(ROW_COUNTERPARTS)
    assert set(ROW_COUNTERPARTS.values()) <= set(SPARSE_OPTIMIZERS)
    for name in OPTIMIZER_NAMES:
        config = OptimizerConfig(name, lr=0.1)
        built = config.build([torch.nn.Parameter(torch.zeros(2))])
        assert isinstance(built, torch_optimizer_class(name))
        assert sparse_optimizer_for(config)["name"] == ROW_COUNTERPARTS[name]


def test_an_unknown_dense_optimizer_is_named_with_the_ones_to_use() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'lbfgs'; use one of sgd, momentum, adam, adagrad"):
        OptimizerConfig("lbfgs")


def test_the_built_in_tasks_are_the_names_the_command_line_lists() -> None:
    assert tuple(TASKS) == TASK_NAMES
    model = next(a for a in _commands(cli.build_parser())["train"]._actions if a.dest == "model")
    assert all(name in model.help for name in TASK_NAMES)


def test_the_spec_room_exports_what_users_name() -> None:
    assert spec.SparseAdagrad().to_dict()["name"] == "adagrad"
    assert spec.UniformRows(seed=1).to_dict()["kind"] == "uniform"
    assert set(spec.__all__) <= set(dir(spec))
    with pytest.raises(AttributeError, match="SparseRMSProp"):
        spec.SparseRMSProp  # noqa: B018


def test_reading_the_dense_names_imports_neither_torch_nor_grpc() -> None:
    code = ("import sys, towerflow.ps.spec.dense, towerflow.training.names; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_every_listed_command_has_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(_commands(cli.build_parser())) == set(cli._COMMANDS)
    monkeypatch.setitem(cli._COMMANDS, "bench", "bench")
    with pytest.raises(ModuleNotFoundError, match="towerflow.cli.bench"):
        cli.build_parser()
