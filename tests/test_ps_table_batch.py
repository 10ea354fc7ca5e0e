"""All of a model's tables in one request per ps task per step.

A model written the plain PyTorch way (DeepFM: one ``nn.Embedding`` per
field, looked up one after the other) is trained under the ``ParameterServer``
strategy on two real ps tasks in this process (authenticated gRPC on
127.0.0.1). Its tables' pulls travel together ahead of the forward, their
pushes together after backward; the rows and updates are those of one
request per table.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials, unary
from towerflow.errors import InvalidArgumentError, NotFoundError
from towerflow.models.deepfm import DeepFM, deepfm_loss
from towerflow.ps import tables_pb2 as tpb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.config import TableConfig
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.worker.tables.prefetch import MAX_RECORDINGS
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"batch-secret")
FIELDS = [50, 7, 30, 12, 9, 40, 25, 11]  # 8 fields: 16 tables (vectors and weights)


@pytest.fixture
def ps_servers(start_ps_tasks):
    return start_ps_tasks(SECRET)


def batches(count: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        fields = [torch.randint(0, n, (32,), generator=g) for n in FIELDS]
        out.append((fields, torch.empty(0), (fields[0] % 2).float()))
    return out


def deepfm() -> DeepFM:
    torch.manual_seed(0)
    return DeepFM(FIELDS, dim=4, hidden=(8,))


def loss(model: nn.Module, batch) -> torch.Tensor:
    fields, _, labels = batch
    return deepfm_loss(model, (fields, None, labels))


def strategy_for(spec, **options) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET, device="cpu",
                           server=False, **options)


def requests(strategy: ParameterServer) -> int:
    tables = strategy._tables  # the model's tables' client: requests sent so far
    return sum(count for count, _, _ in tables.client.wire.values())


def test_a_16_table_model_makes_one_request_per_ps_per_step(ps_servers, caplog) -> None:
    strategy = strategy_for(ps_servers)
    model = strategy.prepare(deepfm(), OptimizerConfig("adagrad", lr=0.05))
    try:
        assert len(strategy._tables.modules) == 16
        data = batches(6)
        strategy.run_step(loss, data[0])  # the first step records where the ids come from
        for batch in data[1:]:
            before = requests(strategy)
            strategy.run_step(loss, batch)
            # one pull request and one push request to each of the 2 ps tasks
            assert requests(strategy) - before == 4
        assert strategy._tables.prefetcher.recordings == 1
    finally:
        strategy.shutdown()
    assert model is not None


def test_batched_steps_train_exactly_as_one_request_per_table(start_ps_tasks) -> None:
    """The same steps with the prefetcher off (one request per table) give the same rows."""
    results = []
    for prefetch in (True, False):
        strategy = strategy_for(start_ps_tasks(SECRET))  # fresh ps tasks for each run
        model = strategy.prepare(deepfm(), OptimizerConfig("adagrad", lr=0.05))
        try:
            strategy._tables.prefetcher.enabled = prefetch
            losses = [float(strategy.run_step(loss, b).loss) for b in batches(4)]
            sent = requests(strategy)
            tables = [m for _, m in strategy._tables.modules]
            rows = [t.client.pull(t.config, torch.arange(t.num_rows)) for t in tables]
            dense = [p.detach().clone() for p in model.parameters()]
            results.append((losses, rows, dense, sent))
        finally:
            strategy.shutdown()
    (l1, r1, d1, n1), (l2, r2, d2, n2) = results
    assert l1 == l2
    for a, b in zip(r1 + d1, r2 + d2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the first step pulls table by table (it records the recipe), then 2 + 2 per step;
    # one request per table: 16 x 2 pulls + 2 pushes every step
    assert (n1, n2) == (34 + 3 * 4, 4 * 34)
