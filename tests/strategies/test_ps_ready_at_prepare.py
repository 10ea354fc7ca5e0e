"""Tables ready when ``prepare`` returns: a forward, a checkpoint and an export before the
first step, as TensorFlow 1's ``managed_session`` returns with every variable initialised.

A model written the plain PyTorch way (three ``nn.Embedding(..., sparse=True)``: one
``from_pretrained``, one frozen, one with ``padding_idx``) on real ps tasks served from this
process (authenticated gRPC on 127.0.0.1).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from towerflow import serving
from towerflow.checkpoint import CheckpointManager
from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.strategies import OptimizerConfig, SingleDevice
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks
from towerflow.training.session import checkpoint_metadata, restore_latest

SECRET = Credentials(secret=b"ready-secret")
ITEMS, GENRES, USERS = 40, 12, 30


class ThreeTables(nn.Module):
    """A click model with three tables: pretrained items, frozen genres, users with a pad row."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.item = nn.Embedding.from_pretrained(torch.randn(ITEMS, 4, generator=g),
                                                 freeze=False, sparse=True)
        self.genre = nn.Embedding.from_pretrained(torch.randn(GENRES, 4, generator=g),
                                                  freeze=True, sparse=True)
        self.user = nn.Embedding(USERS, 4, padding_idx=0, sparse=True)
        self.out = nn.Linear(12, 1)

    def forward(self, item: torch.Tensor, genre: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.item(item), self.genre(genre), self.user(user)], 1)
        return self.out(x).squeeze(1)


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, USERS, (16,), generator=g)
    user[:4] = 0  # the pad row
    return (torch.randint(0, ITEMS, (16,), generator=g),
            torch.randint(0, GENRES, (16,), generator=g), user)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    *x, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(*x), labels)


def labelled(seed: int) -> tuple[torch.Tensor, ...]:
    x = inputs(seed)
    return (*x, (x[0] % 2).float())


def strategy_for(spec: Any, rank: int = 0) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", rank), whole_table_bytes=None, credentials=SECRET, device="cpu",
                           server=False)


def rows_on_ps(module: Any, count: int) -> torch.Tensor:
    return module.client.pull(module.config, torch.arange(count))


def test_the_chiefs_model_deep_copies_and_its_small_tables_serve_a_forward_whole() -> None:
    """The default path (these tables are small: whole with the dense variables)."""
    with ps_tasks(SECRET) as spec:
        model = ThreeTables()
        local = copy.deepcopy(model)
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                   device="cpu", server=False)
        try:
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
            twin = copy.deepcopy(model)  # the chief's Init hook holds no strategy to copy
            with torch.no_grad():
                torch.testing.assert_close(model(*inputs(1)), local(*inputs(1)))
                torch.testing.assert_close(twin(*inputs(1)), local(*inputs(1)))
            assert strategy.global_step == 0
        finally:
            strategy.shutdown()


@pytest.mark.parametrize("num_ps", [1, 2])
def test_tables_hold_the_modules_own_rows_when_prepare_returns(num_ps: int) -> None:
    with ps_tasks(SECRET, num_ps) as spec:
        model = ThreeTables()
        local = copy.deepcopy(model)
        strategy = strategy_for(spec)
        try:
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
            # read from the ps tasks directly: nothing of the strategy ran after prepare
            assert torch.equal(rows_on_ps(model.item, ITEMS), local.item.weight)
            assert torch.equal(rows_on_ps(model.genre, GENRES), local.genre.weight)
            user = rows_on_ps(model.user, USERS)
            assert torch.equal(user, local.user.weight) and not user[0].any()
            with torch.no_grad():
                torch.testing.assert_close(model(*inputs(1)), local(*inputs(1)))
            assert strategy.global_step == 0
        finally:
            strategy.shutdown()


def test_a_checkpoint_and_an_export_before_the_first_step_serve_the_start(tmp_path) -> None:
    with ps_tasks(SECRET) as spec:
        model = ThreeTables()
        local = copy.deepcopy(model)
        strategy = strategy_for(spec)
        try:
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
            groups = strategy.state_dict()  # the tables' parts stream from the ps tasks
            metadata = checkpoint_metadata(strategy)
            path = CheckpointManager(tmp_path / "train").save(metadata["step"], groups, metadata)
        finally:
            strategy.shutdown()
    served = serving.load(serving.export(path, tmp_path / "export"), ThreeTables())
    assert metadata["step"] == 0
    with torch.no_grad():
        torch.testing.assert_close(served(*inputs(2)), local(*inputs(2)))


def _trained_on_the_ps(tmp_path) -> tuple[CheckpointManager, torch.Tensor]:
    manager = CheckpointManager(tmp_path / "ps")
    with ps_tasks(SECRET) as spec:
        strategy = strategy_for(spec)
        try:
            model = ThreeTables()
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
            for step in range(3):
                strategy.run_step(loss_fn, labelled(step))
            groups = strategy.state_dict()
            metadata = checkpoint_metadata(strategy)
            manager.save(metadata["step"], groups, metadata)
            with torch.no_grad():
                expected = model(*inputs(9))
        finally:
            strategy.shutdown()
    return manager, expected


def _trained_in_one_process(tmp_path) -> tuple[CheckpointManager, torch.Tensor]:
    manager = CheckpointManager(tmp_path / "one")
    strategy, model = SingleDevice("cpu"), ThreeTables()
    strategy.prepare(model, OptimizerConfig("sgd", lr=0.3))
    for step in range(3):
        strategy.run_step(loss_fn, labelled(step))
    manager.save(3, strategy.state_dict(), checkpoint_metadata(strategy))
    with torch.no_grad():
        return manager, model(*inputs(9))


@pytest.mark.parametrize("trained", [_trained_on_the_ps, _trained_in_one_process],
                         ids=["ps-checkpoint", "one-process-checkpoint"])
def test_a_forward_after_a_restore_serves_the_checkpoints_rows(tmp_path, trained) -> None:
    manager, expected = trained(tmp_path)
    with ps_tasks(SECRET) as spec:
        model = ThreeTables()
        strategy = strategy_for(spec)
        try:
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
            assert restore_latest(manager, strategy) is not None
            with torch.no_grad():  # the first forward sends the restore to the ps tasks
                torch.testing.assert_close(model(*inputs(9)), expected)
            assert strategy.global_step == 3
        finally:
            strategy.shutdown()


def test_a_non_chief_forward_waits_for_the_chief_and_sees_its_values() -> None:
    with ps_tasks(SECRET, num_workers=2) as spec:
        chief, other = strategy_for(spec, 0), strategy_for(spec, 1)
        chief_model, other_model = ThreeTables(), ThreeTables()
        returned = threading.Event()
        errors: list[BaseException] = []

        def prepare_other() -> None:
            try:
                other.prepare(other_model, OptimizerConfig("adagrad", lr=0.1))
                returned.set()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        thread = threading.Thread(target=prepare_other, daemon=True)
        try:
            chief.prepare(chief_model, OptimizerConfig("adagrad", lr=0.1))
            thread.start()
            # the chief has created its tables but sent no Init: the other worker still waits
            assert not returned.wait(0.5) and thread.is_alive() and not errors
            with torch.no_grad():
                expected = chief_model(*inputs(4))  # its first forward initialises the ps tasks
            thread.join(timeout=60)
            assert returned.is_set() and not errors
            with torch.no_grad():
                torch.testing.assert_close(other_model(*inputs(4)), expected)
        finally:
            thread.join(timeout=60)
            other.shutdown()
            chief.shutdown()
