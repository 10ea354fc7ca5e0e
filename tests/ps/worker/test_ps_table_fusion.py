"""A model's tables that the ps treats alike share one table on the ps tasks.

The fused layout is invisible above the table client: training gives the rows
of separate tables bit for bit, checkpoints hold each table under its own
name, and a checkpoint restores into another layout. ps tasks are real
``Server``s on 127.0.0.1 in this process, authenticated gRPC.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary_stream
from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import ModPartitioner, RangePartitioner
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.tables import sparse_tables
from towerflow.ps.worker.tables.checkpoint import TABLES_GROUP
from towerflow.ps.worker.tables.fusion import fuse_tables
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.training.session import checkpoint_metadata, restore_latest

SECRET = Credentials(secret=b"fusion-secret")
SGD = {"name": "sgd", "hyper": {}}
INIT = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 1}


def table(name: str, rows: int, dim: int = 4, *, optimizer=SGD, init=INIT, part=None):
    return TableConfig(name, part or ModPartitioner(2, num_rows=rows), dim, optimizer, init)


def test_only_tables_the_ps_treats_alike_are_fused_each_id_on_its_own_ps_task() -> None:
    configs = [table("a", 5), table("b", 3), table("c", 7, dim=2), table("d", 4),
               table("e", 6, optimizer={"name": "adagrad", "hyper": {}}),
               table("f", 6, part=RangePartitioner(6, 2)),
               table("g", 2, init={**INIT, "seed": 9})]  # another seed: fused all the same
    fused, views = fuse_tables(configs)
    assert [(f.name, f.num_rows, f.dim) for f in fused] == [("a+3", 16, 4)]
    assert {n: v.offset for n, v in views.items()} == {"a": 0, "b": 6, "d": 10, "g": 14}
    assert all(v.offset % 2 == 0 for v in views.values())  # id i stays on ps task i % 2
    assert fused[0].initializer["seed"] != INIT["seed"]  # its own seed, from its name
    two, apart = fuse_tables(configs, extras=["x", "y", "x", "y", "x", "x", "x"])
    # what else must be equal (how they push) is: a with g, b with d
    assert [f.name for f in two] == ["a+1", "b+1"]
    assert {n: v.table.name for n, v in apart.items()} == {"a": "a+1", "g": "a+1",
                                                           "b": "b+1", "d": "b+1"}


class Fields(nn.Module):
    """Three fields, each its own ``nn.Embedding(sparse=True)``, in the order given."""

    def __init__(self, order=("user", "item", "genre")) -> None:
        super().__init__()
        torch.manual_seed(0)
        sizes = {"user": 30, "item": 17, "genre": 9}
        self.order = order
        for name in order:
            setattr(self, name, nn.Embedding(sizes[name], 4, sparse=True))
        self.out = nn.Linear(12, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = [getattr(self, n)(ids[:, i]) for i, n in enumerate(("user", "item", "genre"))]
        return self.out(torch.cat(rows, 1)).squeeze(1)


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(ids), (ids[:, 0] % 2).float())


def batches(count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randint(0, n, (16,), generator=g) for n in (30, 17, 9)], 1)
            for _ in range(count)]


def train(spec, model: nn.Module, steps: list[torch.Tensor]) -> ParameterServer:
    strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                               server=False, table_part_bytes=256)
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
    for ids in steps:
        strategy.run_step(loss, ids)
    return strategy


def tables_of(strategy: ParameterServer) -> dict[str, torch.Tensor]:
    return {m.config.name: m.client.pull(m.config, torch.arange(m.num_rows))
            for _, m in strategy._tables.modules}


def test_fused_tables_train_bit_exact_as_separate_ones(start_ps_tasks, monkeypatch) -> None:
    runs = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(sparse_tables, "fuse_tables", lambda configs, extras: ([], {}))
        strategy = train(start_ps_tasks(SECRET), Fields(), batches(5))
        try:
            assert len(strategy._tables.fused) == (1 if fuse else 0)
            runs.append((tables_of(strategy), [p.detach().clone()
                                               for p in strategy.model.parameters()]))
        finally:
            strategy.shutdown()
    (fused, dense_a), (apart, dense_b) = runs
    assert fused.keys() == apart.keys() == {"user", "item", "genre"}
    for name in fused:
        torch.testing.assert_close(fused[name], apart[name], rtol=0, atol=0)
    for a, b in zip(dense_a, dense_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_checkpoint_holds_each_table_by_name_and_restores_into_another_layout(
        start_ps_tasks, tmp_path) -> None:
    manager = CheckpointManager(tmp_path / "run", max_to_keep=None)
    strategy = train(start_ps_tasks(SECRET), Fields(), batches(4))
    try:
        saved = tables_of(strategy)
        path = manager.save(strategy.global_step, strategy.state_dict(),
                            checkpoint_metadata(strategy))
    finally:
        strategy.shutdown()
    infos = read_checkpoint(path).chunked[TABLES_GROUP].infos
    assert {i["table"] for i in infos} == {"user", "item", "genre"}
    # built in another order: the fused table's layout (every offset) differs
    strategy = ParameterServer(start_ps_tasks(SECRET), TaskInfo("worker", 0), whole_table_bytes=None,
                               credentials=SECRET,
                               device="cpu", server=False)
    strategy.prepare(Fields(order=("genre", "item", "user")), OptimizerConfig("adagrad", lr=0.3))
    try:
        ckpt = restore_latest(manager, strategy)
        assert strategy.global_step == ckpt.step == 4  # the chief initialises from it
        views = strategy._tables.views
        assert views["genre"].offset == 0 and views["user"].offset > 0
        restored = tables_of(strategy)
        for name in saved:
            torch.testing.assert_close(restored[name], saved[name], rtol=0, atol=0)
    finally:
        strategy.shutdown()


def test_an_export_range_is_checked(start_ps_tasks) -> None:
    spec = start_ps_tasks(SECRET)
    strategy = train(spec, Fields(), batches(1))
    try:
        fused = strategy._tables.fused[0]
        channel = make_channel(spec.task_address("ps", 0), SECRET)
        method = "/towerflow.ps.Tables/ExportRows"
        try:
            request = tpb.ExportRowsRequest(table=fused.name, shard=0, id_start=9, id_stop=3)
            with pytest.raises(InvalidArgumentError, match=r"\[9, 3\)"):
                list(unary_stream(channel, method, request.SerializeToString(), timeout=10))
            request = tpb.ExportRowsRequest(table=fused.name, shard=0, id_start=4, id_stop=10)
            chunks = [tpb.RowChunk.FromString(c) for c in
                      unary_stream(channel, method, request.SerializeToString(), timeout=10)]
            ids = torch.frombuffer(bytearray(b"".join(c.ids for c in chunks)), dtype=torch.int64)
            assert ids.tolist() == [4, 6, 8] and chunks[0].total == 3  # this shard's ids only
        finally:
            channel.close()
    finally:
        strategy.shutdown()
