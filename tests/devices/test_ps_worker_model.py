"""A ps worker's model holds its own updates, on the CPU and on a device the batches do not
come from (the CPU twin of ``test_gpu_paths``' GPU worker; ``lazy`` stands in for the GPU).

An async click model's dense push rides with the next step's table pull, so between steps
the worker's model lags its last dense update; ``strategy.settle()``, ``model.state_dict()``
and the end of a loop settle it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.ps import ShardedEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"worker-model-secret")


@pytest.fixture
def ps_servers(start_ps_tasks):
    """Two ps tasks (dense and table services) in this process, serving after Done."""
    return start_ps_tasks(SECRET)


class _Click(nn.Module):
    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.emb = embedding
        self.hidden = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(ids)))).squeeze(1)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


class _IdsBack(TorchFunctionMode):
    """Records every copy of an integer tensor from a device other than the CPU to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("to", "cpu", "copy_", "numpy", "tolist", "item") and args \
                and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" \
                and not args[0].is_floating_point():
            self.copies.append(f"{name} of {args[0].dtype} {tuple(args[0].shape)}")
        return out


@pytest.mark.parametrize("where", ["cpu", "second"])
def test_an_async_worker_holds_its_own_dense_updates_and_rows_match_local_steps(
        ps_servers, second_device, where) -> None:
    device = torch.device("cpu") if where == "cpu" else second_device
    torch.manual_seed(0)
    local = _Click(nn.EmbeddingBag(50, 4, mode="sum"))
    model = _Click(nn.EmbeddingBag(50, 4, mode="sum", sparse=True))
    model.load_state_dict(local.state_dict())
    strategy = ParameterServer(ps_servers, TaskInfo("worker", 0), credentials=SECRET,
                               device=device, server=False, sparse_threshold_bytes=100)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.5)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        assert isinstance(model.emb, ShardedEmbedding)
        assert model.hidden.weight.device.type == device.type
        assert strategy.global_step == 0  # the chief has created the tables
        with torch.no_grad():  # the local copy starts from the table's rows
            local.emb.weight.copy_(model.emb.client.pull(model.emb.config, torch.arange(50)))
        ids_back = _IdsBack()
        for step in range(3):
            ids = torch.randint(0, 50, (16, 5))  # the batch comes from the CPU
            labels = torch.randint(0, 2, (16,)).float()
            with ids_back:
                result = strategy.run_step(_loss, (ids, labels))
            assert result.global_step == step + 1
            optimizer.zero_grad()
            _loss(local, (ids, labels)).backward()
            optimizer.step()
        # the table's ids were read from the batch's host copy, never back from the device
        assert ids_back.copies == []
        # model.state_dict() settles the dense push still carried for the next table pull
        state = model.state_dict()
        torch.testing.assert_close(state["out.weight"].cpu(), local.out.weight.detach(),
                                   rtol=1e-5, atol=1e-6)
        strategy.settle()
        torch.testing.assert_close(model.out.weight.cpu(), local.out.weight.detach(),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.hidden.weight.cpu(), local.hidden.weight.detach(),
                                   rtol=1e-5, atol=1e-6)
        rows = model.emb.client.pull(model.emb.config, torch.arange(50))
        torch.testing.assert_close(rows, local.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    finally:
        strategy.shutdown()


def test_after_settle_the_workers_parameters_are_the_ps_tasks_own(ps_servers) -> None:
    torch.manual_seed(1)
    model = _Click(nn.EmbeddingBag(50, 4, mode="sum", sparse=True))
    strategy = ParameterServer(ps_servers, TaskInfo("worker", 0), credentials=SECRET,
                               device="cpu", server=False, sparse_threshold_bytes=100)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        for _ in range(2):
            strategy.run_step(_loss, (torch.randint(0, 50, (16, 5)), torch.ones(16)))
        strategy.settle()
        mine = [a.copy() for a in strategy._buffers.host_param_arrays]  # the model's, flat
        held = [a.copy() for a in mine]
        assert strategy.client.pull(held) == 2  # the ps tasks' values and step
        for own, ps in zip(mine, held, strict=True):
            torch.testing.assert_close(torch.from_numpy(own), torch.from_numpy(ps))
    finally:
        strategy.shutdown()
