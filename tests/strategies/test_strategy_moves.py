"""A run moves between one process and a parameter server with its optimizer state.

Trained on 2 in-process ps tasks (real ``Server``s on 127.0.0.1, authenticated gRPC) and
resumed in one process, or the other way round: the next step is the step the first
strategy would have taken (the optimizer's slots and step carried over, not started afresh).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.strategies.single import SingleDevice
from towerflow.testing.inprocess import ps_tasks

SECRET = Credentials(secret=b"moves-secret")
OPTIMIZERS = [OptimizerConfig("adam", lr=0.05), OptimizerConfig("adagrad", lr=0.3),
              OptimizerConfig("sgd", lr=0.1, momentum=0.9)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


def loss_fn(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x).squeeze(1), y)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=g)
    return x, x.sum(1)


def _ps(spec) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                           server=False)


def _params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("config", OPTIMIZERS, ids=lambda c: c.name + ("-momentum" * bool(c.momentum)))
def test_a_ps_run_resumes_in_one_process_with_its_optimizer_state(config) -> None:
    with ps_tasks(SECRET) as spec:
        ps = _ps(spec)
        try:
            ps.prepare(model(), config)
            for seed in range(3):
                ps.run_step(loss_fn, batch(seed))
            groups, metadata = ps.state_dict(), ps.state_metadata()
            ps.run_step(loss_fn, batch(3))  # the step the ps takes next
            want = {k: v.detach().clone() for k, v in ps.state_dict()["model"].items()}
        finally:
            ps.shutdown()
    local = SingleDevice("cpu")
    moved = model()
    local.prepare(moved, config)
    local.load_state(groups, metadata)
    assert local.global_step == 3
    local.run_step(loss_fn, batch(3))
    for name, value in _params(moved).items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("config", OPTIMIZERS, ids=lambda c: c.name + ("-momentum" * bool(c.momentum)))
def test_a_one_process_run_resumes_on_a_ps_with_its_optimizer_state(config) -> None:
    local = SingleDevice("cpu")
    trained = model()
    local.prepare(trained, config)
    for seed in range(3):
        local.run_step(loss_fn, batch(seed))
    groups, metadata = local.state_dict(), local.state_metadata()
    groups = {g: {k: v.clone() for k, v in t.items()} for g, t in groups.items()}
    local.run_step(loss_fn, batch(3))  # the step one process takes next
    want = _params(trained)
    with ps_tasks(SECRET) as spec:
        ps = _ps(spec)
        try:
            moved = model()
            ps.prepare(moved, config)
            ps.load_state(groups, metadata)
            ps.run_step(loss_fn, batch(3))
            got = {k: v.detach().clone() for k, v in ps.state_dict()["model"].items()}
        finally:
            ps.shutdown()
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_another_kind_of_optimizer_starts_afresh_and_says_so(caplog) -> None:
    with ps_tasks(SECRET) as spec:
        ps = _ps(spec)
        try:
            ps.prepare(model(), OptimizerConfig("adagrad", lr=0.3))
            ps.run_step(loss_fn, batch(0))
            groups, metadata = ps.state_dict(), ps.state_metadata()
        finally:
            ps.shutdown()
    local = SingleDevice("cpu")
    local.prepare(model(), OptimizerConfig("adam", lr=0.05))
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        local.load_state(groups, metadata)
    assert "the checkpoint's optimizer state is adagrad's" in caplog.text
    assert not local.optimizer.state


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(20, 4, sparse=True)  # a table on the ps, a weight in one process
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


def table_loss(m: nn.Module, batch) -> torch.Tensor:
    ids, y = batch
    return nn.functional.mse_loss(m(ids), y)


def table_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (8,), generator=g)
    return ids, (ids % 3).float()


def _saved(strategy, directory):
    """``strategy``'s checkpoint written to ``directory`` and read back (tables as parts)."""
    from towerflow.checkpoint import CheckpointManager, read_checkpoint
    from towerflow.training.session import checkpoint_metadata

    groups = strategy.state_dict()
    metadata = checkpoint_metadata(strategy)
    return read_checkpoint(CheckpointManager(directory).save(metadata["step"], groups, metadata))


def _table(ckpt) -> torch.Tensor:
    rows = torch.full((20, 4), float("nan"))
    for _, tensors in ckpt.chunked["ps_tables"].parts():
        rows.index_copy_(0, tensors["ids"], tensors["rows"])
    return rows


def test_a_ps_runs_tables_resume_in_one_process_as_weights_with_their_accumulators(
        tmp_path) -> None:
    config = OptimizerConfig("adagrad", lr=0.3, initial_accumulator_value=0.1)
    with ps_tasks(SECRET) as spec:
        ps = _ps(spec)
        try:
            ps.prepare(Tables(), config)
            for seed in range(3):
                ps.run_step(table_loss, table_batch(seed))
            first = _saved(ps, tmp_path / "a")
            ps.run_step(table_loss, table_batch(3))
            want = _table(_saved(ps, tmp_path / "b"))
        finally:
            ps.shutdown()
    local = SingleDevice("cpu")
    moved = Tables()
    local.prepare(moved, config)
    local.load_state({**first.groups, **first.chunked}, first.metadata["strategy"])
    torch.testing.assert_close(moved.emb.weight.detach(), _table(first), rtol=0, atol=0)
    assert set(local.optimizer.state[moved.emb.weight]) == {"sum", "step"}
    local.run_step(table_loss, table_batch(3))  # the step the ps took: the same rows
    torch.testing.assert_close(moved.emb.weight.detach(), want, rtol=1e-5, atol=1e-6)


def test_a_one_process_runs_table_weights_start_the_ps_tables(tmp_path) -> None:
    config = OptimizerConfig("adagrad", lr=0.3)
    local = SingleDevice("cpu")
    trained = Tables()
    local.prepare(trained, config)
    for seed in range(3):
        local.run_step(table_loss, table_batch(seed))
    groups = {g: {k: v.clone() for k, v in t.items()} for g, t in local.state_dict().items()}
    metadata = local.state_metadata()
    with ps_tasks(SECRET) as spec:
        ps = _ps(spec)
        try:
            ps.prepare(Tables(), config)
            ps.load_state(groups, metadata)
            ckpt = _saved(ps, tmp_path)  # initialises the ps tasks from the checkpoint
            got, dense = _table(ckpt), ckpt.groups["model"]
        finally:
            ps.shutdown()
    torch.testing.assert_close(got, trained.emb.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dense["out.weight"], trained.out.weight.detach(), rtol=0, atol=0)
