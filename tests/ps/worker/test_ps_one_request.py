"""One round trip per ps task and step: the dense push travels with the table pull.

An async click model (a table and dense layers on the ps tasks) sends, from
its second step on, one ``RowBatch`` request per ps task and step: the
previous step's row gradients, the previous step's dense gradient
(``RowBatchRequest.dense``) and this step's pull, answered with the rows and
the fresh dense parameters before the forward runs. Two real ps tasks
(dense and table services) on 127.0.0.1 in this process.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from row_frames import frame, unframe
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.models.deepfm import DeepFM, deepfm_loss
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import unpack
from towerflow.ps.wire.tables import table_spec
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"one-request-secret")
ROWS, DIM, STEPS = 200, 8, 6


class Click(nn.Module):
    """A click model written the plain PyTorch way: ``nn.EmbeddingBag(sparse=True)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.hidden = nn.Linear(DIM, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(ids)))).squeeze(-1)


def click_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    return F.binary_cross_entropy_with_logits(model(ids), labels)


def click_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, ROWS, (16, 5), generator=g),
             torch.randint(0, 2, (16,), generator=g).float()) for _ in range(count)]


def worker(spec, **options) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                           server=False, **options)


def table_requests(strategy: ParameterServer) -> int:
    return sum(count for count, _, _ in strategy._tables.client.wire.values())


def dense_stats(strategy: ParameterServer, key: str) -> list[int]:
    return [stats[key] for stats in strategy.client.stats()]


def local_sgd(model: nn.Module, batches, lr: float) -> nn.Module:
    """The same steps in one process with torch.optim.SGD (one worker: async is sequential)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        optimizer.zero_grad()
        click_loss(model, batch).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("pull_ahead", [True, False])
def test_a_click_model_trains_with_one_request_per_ps_task_a_step(start_ps_tasks,
                                                                  pull_ahead) -> None:
    """Dense and row pushes ride on the next pull, each applied once, and one worker's
    async steps equal plain SGD; a forward whose tables are not pulled ahead (the
    prefetcher off) gets its dense push sent alone first, with the same result."""
    spec = start_ps_tasks(SECRET)
    model = Click()
    local = copy.deepcopy(model)
    strategy = worker(spec)
    strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
    data = click_batches(STEPS)
    try:
        assert strategy._carrier is not None
        strategy._tables.prefetcher.enabled = pull_ahead
        strategy.run_step(click_loss, data[0])  # records where the ids come from
        for batch in data[1:]:
            before = table_requests(strategy)
            result = strategy.run_step(click_loss, batch)
            assert table_requests(strategy) - before == 2  # one per ps task
        opened = [shard._stream is not None for shard in strategy.client.shards]
        assert opened == [not pull_ahead] * 2  # no dense request of its own when carried
        # the last step's dense push waits for the next pull: applied once each, so far
        assert dense_stats(strategy, "applied") == [STEPS - 1] * 2
        assert result.global_step == STEPS
        assert strategy.global_step == STEPS  # sends it
        assert dense_stats(strategy, "applied") == [STEPS] * 2
        assert dense_stats(strategy, "duplicates") == [0, 0]
        local_sgd(local, data, lr=0.5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, dict(local.named_parameters())[name],
                                       msg=name)
        table = strategy._tables.modules[0][1]
        torch.testing.assert_close(table.client.pull(table.config, torch.arange(ROWS)),
                                   local.emb.weight.detach())
    finally:
        strategy.shutdown()


def test_the_last_carried_dense_push_is_sent_at_shutdown(start_ps_tasks) -> None:
    spec = start_ps_tasks(SECRET)
    strategy = worker(spec)
    strategy.prepare(Click(), OptimizerConfig("sgd", lr=0.5))
    try:
        for batch in click_batches(3):
            strategy.run_step(click_loss, batch)
        assert dense_stats(strategy, "applied") == [2, 2]
        watcher = worker(spec)  # another client reads the shards after this one is gone
        watcher.prepare(Click(), OptimizerConfig("sgd", lr=0.5))
    finally:
        strategy.shutdown()
    try:
        assert dense_stats(watcher, "applied") == [3, 3]
    finally:
        watcher.shutdown()


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sync_and_ssp_keep_the_dense_push_in_its_own_step(start_ps_tasks, mode) -> None:
    strategy = worker(start_ps_tasks(SECRET), mode=mode)
    strategy.prepare(Click(), OptimizerConfig("sgd", lr=0.5))
    try:
        assert strategy._carrier is None
        strategy.run_step(click_loss, click_batches(1)[0])
        assert dense_stats(strategy, "applied") == [1, 1]
    finally:
        strategy.shutdown()


def test_many_tables_on_two_ps_tasks_carry_the_dense_push_applied_once(start_ps_tasks) -> None:
    """16 tables (DeepFM) and its dense layers: one request per ps task a step, every
    table's push and the dense push applied exactly once."""
    fields = [50, 7, 30, 12, 9, 40, 25, 11]
    strategy = worker(start_ps_tasks(SECRET))
    torch.manual_seed(0)
    strategy.prepare(DeepFM(fields, dim=4, hidden=(8,)), OptimizerConfig("adagrad", lr=0.05))
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(4):
            columns = [torch.randint(0, n, (32,), generator=g) for n in fields]
            before = table_requests(strategy)
            strategy.run_step(deepfm_loss, (columns, None, (columns[0] % 2).float()))
            if step:
                assert table_requests(strategy) - before == 2
        assert strategy.global_step == 4
        assert dense_stats(strategy, "applied") == [4, 4]
        client = strategy._tables.client  # every table's deferred pushes sent, then counted
        assert {client.status(m.config, shard).applied
                for _, m in strategy._tables.modules for shard in (0, 1)} == {4}
    finally:
        strategy.shutdown()


def test_a_combined_request_sent_twice_applies_nothing_twice(start_ps_tasks) -> None:
    """The same RowBatch bytes (a row push and a dense push) sent again: both answered
    from their push tables, the rows and the parameters as after the first."""
    spec = start_ps_tasks(SECRET)
    strategy = worker(spec)
    model = Click()
    strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
    try:
        strategy.run_step(click_loss, click_batches(1)[0])
        assert strategy.global_step == 1
        table = strategy._tables.modules[0][1]
        client = table.client
        grads = [np.full_like(a, 0.25) for a in strategy._buffers.host_param_arrays]
        push = strategy.client.prepare_push(grads, lr=1.0)
        ids = torch.tensor([0, 2, 4], dtype=torch.int64)  # shard 0 of the mod partitioner
        row_push = tpb.PushRowsRequest(
            table=table.config.name, shard=0, worker_id=0, incarnation=client.incarnation,
            seq=client.next_seq(), lr=1.0, step=2, num_ids=3, dtype="float32",
            ids=ids.numpy().tobytes(), grads=torch.ones(3, DIM).numpy().tobytes())
        item = tpb.PushPullRowsRequest(push=row_push, pull=tpb.PullRowsRequest(
            table=table.config.name, shard=0, num_ids=3, ids=ids.numpy().tobytes()))
        payload = frame([item], dense=push.requests[0])
        channel = make_channel(spec.task_address("ps", 0), SECRET)
        try:
            answers = [unframe(unary(channel, "/towerflow.ps.Tables/RowBatch", payload,
                                     timeout=10)) for _ in range(2)]
        finally:
            channel.close()
        replies = [reply for reply, _ in answers]
        dense = [data for _, data in answers]
        heads = [pb.PushReply.FromString(unpack(d)[0]) for d in dense]
        assert [h.status for h in heads] == ["applied", "applied"]
        assert [h.duplicate for h in heads] == [False, True]
        assert [r.items[0].push.duplicate for r in replies] == [False, True]
        assert replies[0].items[0].pull.rows == replies[1].items[0].pull.rows
        assert unpack(dense[0])[1] == unpack(dense[1])[1]  # the same parameters
        assert dense_stats(strategy, "applied")[0] == 2
    finally:
        strategy.shutdown()


def test_a_loss_function_that_calls_the_models_parts_gets_the_dense_push_apart(
        start_ps_tasks, caplog) -> None:
    """Without the model's own forward the tables cannot be pulled before it: after the
    first step's push (sent late, once) each step pushes its dense part alone, and a line
    says how to get one request per ps task."""
    strategy = worker(start_ps_tasks(SECRET))
    strategy.prepare(Click(), OptimizerConfig("sgd", lr=0.5))

    def parts_loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, labels = batch
        logits = m.out(torch.relu(m.hidden(m.emb(ids)))).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, labels)

    try:
        with caplog.at_level("WARNING", logger="towerflow.ps"):
            for batch in click_batches(4):
                strategy.run_step(parts_loss, batch)
        assert strategy._carrier is None
        assert "does not call the model (model(inputs))" in caplog.text
        assert dense_stats(strategy, "applied") == [4, 4]  # none waits, none twice
        assert dense_stats(strategy, "duplicates") == [0, 0]
    finally:
        strategy.shutdown()


def test_received_buffers_are_read_in_place_and_never_written_through() -> None:
    """The ps reads a framed batch's ids and gradients as views of the received bytes
    (no copy): a buffer changed after the call changes nothing of the table, and the rows
    it answered are those after the push."""
    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.server.tables.service import TableService
    from towerflow.ps.spec.tables import TableConfig

    config = TableConfig("t", ModPartitioner(1, num_rows=10), 4, {"name": "sgd", "hyper": {}},
                         {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 3})
    service = TableService(0)
    service.init_table(tpb.InitTableRequest(spec=table_spec(config, 0)).SerializeToString())

    def rows() -> torch.Tensor:
        item = tpb.PushPullRowsRequest(pull=tpb.PullRowsRequest(
            table="t", shard=0, num_ids=10, ids=torch.arange(10).numpy().tobytes()))
        reply, _ = unframe(service.row_batch(frame([item])))
        return torch.frombuffer(bytearray(reply.items[0].pull.rows), dtype=torch.float32
                                ).view(10, 4)

    before = rows()
    ids = torch.tensor([1, 3], dtype=torch.int64)
    item = tpb.PushPullRowsRequest(
        pull=tpb.PullRowsRequest(table="t", shard=0, num_ids=2, ids=ids.numpy().tobytes()),
        push=tpb.PushRowsRequest(table="t", shard=0, worker_id=0, incarnation=1, seq=1, lr=1.0,
                                 step=1, num_ids=2, dtype="float32", ids=ids.numpy().tobytes(),
                                 grads=torch.ones(2, 4).numpy().tobytes()))
    received = bytearray(frame([item]))  # a writable buffer: the ps's views could write it
    data = service.row_batch(received)
    received[-32:] = torch.full((2, 4), float("nan")).numpy().tobytes()  # the gradients
    received[-48:-32] = torch.tensor([5, 7]).numpy().tobytes()  # the push's ids
    after = rows()
    expected = before.clone()
    expected[[1, 3]] -= 1.0
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    answered = torch.frombuffer(unframe(data)[0].items[0].pull.rows, dtype=torch.float32)
    torch.testing.assert_close(answered.view(2, 4), expected[[1, 3]], rtol=0, atol=0)


@pytest.mark.parametrize("lie", ["parts short", "parts long", "a part missing", "dense absent"])
def test_a_framed_batch_that_lies_about_its_buffers_is_refused_and_applies_nothing(lie) -> None:
    """A peer with the secret that sends buffers other than its header announces gets an
    error naming the batch; no push of it is applied."""
    from towerflow.errors import DataLossError, InvalidArgumentError
    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.server.tables.service import TableService
    from towerflow.ps.spec.tables import TableConfig
    from towerflow.ps.wire.framing import pack_parts

    config = TableConfig("t", ModPartitioner(1, num_rows=10), 4, {"name": "sgd", "hyper": {}},
                         {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 3})
    service = TableService(0)
    service.init_table(tpb.InitTableRequest(spec=table_spec(config, 0)).SerializeToString())
    ids = torch.tensor([1, 3], dtype=torch.int64).numpy().tobytes()
    grads = torch.ones(2, 4).numpy().tobytes()
    header = tpb.RowBatchRequest(items=[tpb.PushPullRowsRequest(
        pull=tpb.PullRowsRequest(table="t", shard=0, num_ids=2),
        push=tpb.PushRowsRequest(table="t", shard=0, worker_id=0, incarnation=1, seq=1, lr=1.0,
                                 step=1, num_ids=2, dtype="float32"))])
    parts = [ids, ids, grads]
    sizes = [len(p) for p in parts]
    if lie == "parts short":
        sizes[2] -= 4
    elif lie == "parts long":
        sizes[2] += 4
    elif lie == "a part missing":
        parts, sizes = parts[:2], sizes[:2]
    else:
        header.dense = True
    header.parts.extend(sizes)
    with pytest.raises((DataLossError, InvalidArgumentError), match="RowBatch"):
        service.row_batch(pack_parts(header.SerializeToString(), parts))
    assert service.table("t", 0).status()["applied"] == 0
