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
from row_frames import frame, unframe
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import InvalidArgumentError, NotFoundError
from towerflow.models.deepfm import DeepFM, deepfm_loss
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
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
    return ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                           server=False, **options)


def requests(strategy: ParameterServer) -> int:
    tables = strategy._tables  # the model's tables' client: requests sent so far
    return sum(count for count, _, _ in tables.client.wire.values())


@pytest.mark.parametrize("mode, per_step", [
    ("async", 2),  # the pushes deferred: they travel with the next step's pulls
    ("sync", 4),   # a pull and a push request to each ps task (the push counted in its step)
])
def test_a_16_table_model_makes_one_request_per_ps_per_step(ps_servers, mode, per_step) -> None:
    strategy = strategy_for(ps_servers, mode=mode)
    strategy.prepare(deepfm(), OptimizerConfig("adagrad", lr=0.05))
    try:
        assert len(strategy._tables.modules) == 16
        data = batches(5)
        strategy.run_step(loss, data[0])  # the first step records where the ids come from
        for batch in data[1:]:
            before = requests(strategy)
            strategy.run_step(loss, batch)
            assert requests(strategy) - before == per_step
        assert strategy._tables.prefetcher.recordings == 1
    finally:
        strategy.shutdown()


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
    # the first step pulls table by table (it records the recipe), then one request per ps
    # task a step (the pushes deferred); one request per table: 16 x 2 pulls every step
    assert (n1, n2) == (32 + 3 * 2, 4 * 32)


# --------------------------------------------------------------------------- the RowBatch call
SGD = {"name": "sgd", "hyper": {}}
INIT = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 3}


@pytest.fixture
def tables(table_ps_tasks):
    """Two ps tasks serving the table service alone; tables 'a' and 'b' (10 x 2) on them."""
    spec, clients = table_ps_tasks(SECRET)
    client = clients(1)[0]
    configs = [TableConfig(n, ModPartitioner(2, num_rows=10), 2, SGD, INIT) for n in "ab"]
    for cfg in configs:
        client.init_table(cfg)
    return spec, client, configs


def item(table: str, pull: list[int], push: list[int] | None = None, seq: int = 1):
    request = tpb.PushPullRowsRequest(pull=tpb.PullRowsRequest(
        table=table, shard=0, num_ids=len(pull),
        ids=torch.tensor(pull, dtype=torch.int64).numpy().tobytes()))
    if push is not None:
        request.push.CopyFrom(tpb.PushRowsRequest(
            table=table, shard=0, worker_id=0, incarnation=1, seq=seq, lr=1.0, step=1,
            num_ids=len(push), dtype="float32",
            ids=torch.tensor(push, dtype=torch.int64).numpy().tobytes(),
            grads=torch.ones(len(push), 2).numpy().tobytes()))
    return request


def row_batch(spec, *items) -> tpb.RowBatchReply:
    channel = make_channel(spec.task_address("ps", 0), SECRET)
    try:
        data = unary(channel, "/towerflow.ps.Tables/RowBatch", frame(items), timeout=10)
    finally:
        channel.close()
    return unframe(data)[0]


def rows_of(reply) -> torch.Tensor:
    return torch.frombuffer(bytearray(reply.pull.rows), dtype=torch.float32).view(-1, 2)


def test_one_call_serves_several_tables_and_a_retry_applies_nothing_twice(tables) -> None:
    spec, client, (a, b) = tables
    before = [client.pull(cfg, torch.arange(10)) for cfg in (a, b)]
    batch = (item("a", [0, 2], push=[2, 4]), item("b", [4], push=[0], seq=7), item("b", [6]))
    first = row_batch(spec, *batch)
    assert [r.push.status for r in first.items[:2]] == ["applied", "applied"]
    assert not first.items[2].HasField("push")
    torch.testing.assert_close(rows_of(first.items[0]), torch.stack([before[0][0],
                                                                     before[0][2] - 1]))
    torch.testing.assert_close(rows_of(first.items[1]), before[1][4:5])
    again = row_batch(spec, *batch)  # the same bytes again: answered, not applied twice
    assert [r.push.duplicate for r in again.items[:2]] == [True, True]
    after = [client.pull(cfg, torch.arange(10)) for cfg in (a, b)]
    torch.testing.assert_close(after[0][[2, 4]], before[0][[2, 4]] - 1)
    torch.testing.assert_close(after[1][0], before[1][0] - 1)
    assert [client.status(cfg, 0).applied for cfg in (a, b)] == [1, 1]


@pytest.mark.parametrize("bad, error, pattern", [
    (item("missing", [0]), NotFoundError, "'missing' shard 0 is not on this ps task"),
    (item("b", [3]), InvalidArgumentError, "owned by|shard"),  # id 3 is shard 1's
    (item("b", [0], push=[12]), InvalidArgumentError, "12"),  # out of the table
])
def test_one_bad_item_refuses_the_whole_call_and_nothing_is_applied(tables, bad, error,
                                                                     pattern) -> None:
    spec, client, (a, b) = tables
    before = [client.pull(cfg, torch.arange(10)) for cfg in (a, b)]
    with pytest.raises(error, match=pattern):
        row_batch(spec, item("a", [0], push=[0, 2]), bad)
    after = [client.pull(cfg, torch.arange(10)) for cfg in (a, b)]
    for x, y in zip(before, after, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert [client.status(cfg, 0).applied for cfg in (a, b)] == [0, 0]


def test_pulls_and_pushes_of_many_tables_go_in_one_request_per_ps(tables) -> None:
    spec, client, (a, b) = tables
    before = [client.pull(cfg, torch.arange(10)) for cfg in (a, b)]
    client.wire.clear()
    ids = torch.tensor([1, 2, 3])
    client.push_many([(a, ids, torch.ones(3, 2), True), (b, ids, torch.ones(3, 2), True)],
                     lr=1.0, step=1)
    assert client.wire == {} and client.deferred() == 4  # 2 tables x 2 shards, kept
    rows = client.pull_many([(a, torch.tensor([1, 8])), (b, torch.tensor([2])),
                             (a, torch.tensor([3]))])
    assert {k: v[0] for k, v in client.wire.items()} == {"PushPullRows": 2}
    assert client.deferred() == 0
    torch.testing.assert_close(rows[0], torch.stack([before[0][1] - 1, before[0][8]]))
    torch.testing.assert_close(rows[1], before[1][2:3] - 1)
    torch.testing.assert_close(rows[2], before[0][3:4] - 1)
    client.wire.clear()
    client.push_many([(a, ids, torch.ones(3, 2), False), (b, ids, torch.ones(3, 2), False)],
                     lr=1.0, step=2)
    assert {k: v[0] for k, v in client.wire.items()} == {"PushRows": 2}


def test_a_request_past_max_call_bytes_is_cut_in_order(tables) -> None:
    spec, _, (a, b) = tables
    client = TableClient(spec.job_tasks("ps"), credentials=SECRET, worker_id=1, timeout=10.0,
                         max_call_bytes=3 * 16)  # 3 rows of 8 (id) + 8 (2 floats) bytes
    try:
        expect = [client.pull(cfg, torch.arange(10)) for cfg in (a, b)]
        client.wire.clear()
        ids = torch.arange(10)
        rows = client.pull_many([(a, ids), (b, ids)])
        # 5 ids per shard and table: [3, 2 | 1 ...] pieces of at most 3 rows
        assert client.wire["PullRows"][0] == 8
        torch.testing.assert_close(rows, expect, rtol=0, atol=0)
    finally:
        client.close()


# --------------------------------------------------------------------------- recipes
class Branchy(nn.Module):
    """Chooses its tables' ids by the data (a recipe recorded once does not hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(20, 2, sparse=True)
        self.b = nn.Embedding(20, 2, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first = ids[:, 0] if int(ids.sum()) % 2 else ids[:, 1]
        return (self.a(first) + self.b(ids[:, 2])).sum(1)


class Noisy(Branchy):
    """Draws random ids (a recipe would change the random stream)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        noise = torch.randint(0, 20, ids[:, 0].shape)
        return (self.a(noise) + self.b(ids[:, 2])).sum(1)


class Chained(Branchy):
    """Takes one table's ids from another table's rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.a(ids[:, 0])
        return (rows + self.b((rows[:, 0] > 0).long())).sum(1)


def mse(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).pow(2).mean()


def id_batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 20, (8, 3), generator=g) for _ in range(count)]


def test_a_recipe_that_does_not_hold_is_never_wrong_and_is_given_up_with_one_line(
        start_ps_tasks, caplog) -> None:
    runs = []
    for prefetch in (True, False):
        strategy = strategy_for(start_ps_tasks(SECRET))
        torch.manual_seed(0)
        model = strategy.prepare(Branchy(), OptimizerConfig("sgd", lr=0.5))
        try:
            strategy._tables.prefetcher.enabled = prefetch
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="towerflow.ps"):
                for ids in id_batches(12):
                    strategy.run_step(mse, ids)
            lines = [r.getMessage() for r in caplog.records
                     if "one request each" in r.getMessage()]
            tables = [m for _, m in strategy._tables.modules]
            runs.append(([t.client.pull(t.config, torch.arange(20)) for t in tables], lines,
                         strategy._tables.prefetcher.recordings))
        finally:
            strategy.shutdown()
    (rows, lines, recordings), (plain, none, _) = runs
    for x, y in zip(rows, plain, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert recordings == MAX_RECORDINGS and len(lines) == 1 and none == []
    assert model is not None


@pytest.mark.parametrize("net, reason", [(Noisy, "draws random numbers"),
                                         (Chained, "another table's rows")])
def test_ids_that_cannot_be_known_ahead_are_pulled_one_by_one_with_one_line(
        ps_servers, caplog, net, reason) -> None:
    strategy = strategy_for(ps_servers)
    model = strategy.prepare(net(), OptimizerConfig("sgd", lr=0.5))
    try:
        with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
            for ids in id_batches(3):
                strategy.run_step(mse, ids)
        lines = [r.getMessage() for r in caplog.records if "one request each" in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0]
        assert not strategy._tables.prefetcher.enabled
    finally:
        strategy.shutdown()
    assert isinstance(model.a, ShardedEmbedding)


def test_a_model_prepared_again_pulls_through_its_new_strategy_only(start_ps_tasks) -> None:
    model = deepfm()
    for _ in range(2):  # a strategy shut down leaves no hook on the model
        strategy = strategy_for(start_ps_tasks(SECRET))
        strategy.prepare(model, OptimizerConfig("adagrad", lr=0.05))
        try:
            # the chief's Init (first), the inputs to the model's device, the tables' pull
            # ahead, then the strategy's (the dense push no pull carried)
            assert [h.__name__ for h in model._forward_pre_hooks.values()] == [
                "_initialise", "_to_model_device", "_before", "_before_forward"]
            for batch in batches(3):
                strategy.run_step(loss, batch)
            assert strategy._tables.prefetcher.recordings == 1
        finally:
            strategy.shutdown()
        assert len(model._forward_pre_hooks) == len(model._state_dict_pre_hooks) == 0
