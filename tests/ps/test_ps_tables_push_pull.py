"""Sparse tables on the ps tasks: a step's push and the next pull in one request (PushPullRows)
and the row stream (one long-lived stream per worker and ps task instead of unary calls).

ps tasks are real ``Server``s on 127.0.0.1 in this process, with authenticated gRPC.
"""

from __future__ import annotations

import threading

import pytest
import torch
from row_frames import unframe
from test_ps_tables import (
    INIT,
    SECRET,
    Click,
    call_shard,
    click_loss,
    config,
    expected_rows,
    table_rows,
)

from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.errors import InvalidArgumentError
from towerflow.ps.server.tables.service import TableHost
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer


@pytest.fixture
def cluster(table_ps_tasks):
    """Two ps tasks serving only the table service, and a client of them."""
    spec, clients = table_ps_tasks(SECRET)
    return spec, clients(1)[0]


# --------------------------------------------------------------------------- push and pull at once
def raw_push_pull(spec, shard: int, pull_ids, push: tpb.PushRowsRequest | None = None,
                  *, table: str = "t") -> tpb.PushPullRowsReply:
    request = tpb.PushPullRowsRequest(pull=tpb.PullRowsRequest(
        table=table, shard=shard, num_ids=len(pull_ids),
        ids=torch.tensor(pull_ids, dtype=torch.int64).numpy().tobytes()))
    if push is not None:
        request.push.CopyFrom(push)
    return tpb.PushPullRowsReply.FromString(call_shard(spec, shard, "PushPullRows", request))


def push_request(ids, grads, *, shard: int = 0, seq: int = 1, table: str = "t"):
    return tpb.PushRowsRequest(table=table, shard=shard, worker_id=0, incarnation=1, seq=seq,
                               lr=0.5, step=1, num_ids=len(ids), dtype="float32",
                               ids=torch.tensor(ids, dtype=torch.int64).numpy().tobytes(),
                               grads=torch.as_tensor(grads).numpy().tobytes())


def reply_rows(reply: tpb.PushPullRowsReply, dim: int = 3) -> torch.Tensor:
    return torch.frombuffer(bytearray(reply.pull.rows), dtype=torch.float32).view(-1, dim)


def test_push_pull_rows_applies_the_push_then_answers_rows_that_include_it(cluster):
    spec, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    push = push_request([4, 2], [[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    first = raw_push_pull(spec, 0, [4, 6, 2], push)
    assert (first.push.status, first.push.duplicate, first.push.applied) == ("applied", False, 1)
    expected = before[[4, 6, 2]].clone()
    expected[0] -= 0.5 * torch.tensor([1.0, 2.0, 3.0])
    expected[2] -= 0.5
    torch.testing.assert_close(reply_rows(first), expected)
    again = raw_push_pull(spec, 0, [4, 6, 2], push)  # a retried call: the push applies once
    assert (again.push.status, again.push.duplicate, again.push.applied) == ("applied", True, 1)
    torch.testing.assert_close(reply_rows(again), expected)
    alone = raw_push_pull(spec, 0, [6])  # no push: a pull, and no push reply
    assert not alone.HasField("push") and client.status(cfg, 0).applied == 1
    torch.testing.assert_close(reply_rows(alone), before[[6]], rtol=0, atol=0)


@pytest.mark.parametrize(("push", "pull_ids", "pattern"), [
    (push_request([2], [[float("nan")] * 3]), [2], r"row gradients of id 2 hold \[nan"),
    (push_request([2], [[1.0] * 3]), [3], r"ids\[0\] = 3 belongs to shard 1, not shard 0"),
    (push_request([1], [[1.0] * 3], shard=1), [2],
     r"pushes to table 't' shard 1 but pulls from table 't' shard 0"),
    (push_request([2], [[1.0] * 3], table="u"), [2], r"pushes to table 'u' shard 0 but pulls"),
])
def test_a_refused_push_pull_applies_nothing_and_reads_nothing(cluster, push, pull_ids, pattern):
    spec, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    pulled = client.status(cfg, 0).pulled_rows
    with pytest.raises(InvalidArgumentError, match=pattern):
        raw_push_pull(spec, 0, pull_ids, push)
    torch.testing.assert_close(table_rows(client, cfg), before, rtol=0, atol=0)
    status = client.status(cfg, 0)
    assert (status.applied, list(status.pushes)) == (0, [])
    assert status.pulled_rows == pulled + 10  # table_rows' 10 of shard 0: the call read none


def test_a_deferred_push_travels_with_the_next_pull_and_applies_once(cluster):
    spec, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    other = TableClient(spec.job_tasks("ps"), credentials=SECRET, worker_id=1, timeout=10.0)
    try:
        ids, grads = torch.tensor([3, 4, 9]), torch.ones(3, 3)
        assert client.push(cfg, ids, grads, lr=0.5, step=1, defer=True) == []
        assert client.deferred() == 2  # one request per owning shard, none sent
        torch.testing.assert_close(table_rows(other, cfg), before, rtol=0, atol=0)
        client.wire.clear()
        rows = client.pull(cfg, torch.tensor([4, 0]))  # only shard 0 is asked
        assert client.deferred() == 0  # shard 0's push went with the pull, shard 1's alone
        assert {k: v[0] for k, v in client.wire.items()} == {"PushPullRows": 1, "PushRows": 1}
        torch.testing.assert_close(rows, torch.stack([before[4] - 0.5, before[0]]))
        torch.testing.assert_close(table_rows(other, cfg)[[3, 9]], before[[3, 9]] - 0.5)
        client.push(cfg, torch.tensor([9]), grads[:1], lr=0.5, step=2, defer=True)
        client.push(cfg, torch.tensor([3]), grads[:1], lr=0.5, step=3, defer=True)
        assert client.deferred() == 1  # shard 1's first push was sent before its second
        assert client.wire["PushRows"][0] == 2
        chunks = list(client.export_shard(cfg, 1))  # an export holds every deferred push
        assert client.deferred() == 0
        exported = torch.frombuffer(bytearray(chunks[0].rows), dtype=torch.float32).view(-1, 3)
        torch.testing.assert_close(exported[[1, 4]], torch.stack([before[3] - 1.0,
                                                                  before[9] - 1.0]))
        assert [client.status(cfg, s).applied for s in range(2)] == [1, 3]
        client.push(cfg, torch.tensor([2]), grads[:1], lr=0.5, step=4, defer=True)
        client.close()  # close sends it
        torch.testing.assert_close(table_rows(other, cfg)[2], before[2] - 0.5)
    finally:
        other.close()


def test_deferred_pushes_reach_the_ps_before_the_worker_says_it_is_done(free_ports):
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                        "worker": [f"127.0.0.1:{ports[2]}"]})
    servers = [Server(spec, "ps", i, credentials=SECRET) for i in range(2)]  # end at Done
    model = Click(50, embedding=ShardedEmbedding(50, 4, mode="sum", initializer=INIT,
                                                 defer_push=True))
    strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET, device="cpu",
                               server=False)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        ids = torch.arange(10).view(2, 5)  # rows of both shards
        strategy.run_step(click_loss, (ids, torch.tensor([0.0, 1.0])))
        assert model.emb.client.deferred() == 2
        strategy.shutdown()  # sends them, then Done: the ps tasks end by themselves
        waiters = [threading.Thread(target=s.join, kwargs={"handle_signals": False})
                   for s in servers]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join(30)
        assert not any(w.is_alive() for w in waiters)
        tables = [next(h.service for h in s.services if isinstance(h, TableHost))
                  for s in servers]
        assert [t.table(model.emb.config.name, i).status()["applied"]
                for i, t in enumerate(tables)] == [1, 1]
    finally:
        for server in servers:
            server.stop()


# --------------------------------------------------------------------------- the row stream
def test_rows_of_many_steps_travel_on_one_stream_per_ps_task_without_unary_calls(
        cluster, monkeypatch):
    import towerflow.ps.worker.tables.client as table_client

    _, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    opened, unary_calls = [], []
    real_stream, real_unary = table_client.RowStream, table_client.unary

    def counting_stream(*args, **kwargs):
        opened.append(args)
        return real_stream(*args, **kwargs)

    def counting_unary(*args, **kwargs):
        unary_calls.append(args[1])
        return real_unary(*args, **kwargs)

    monkeypatch.setattr(table_client, "RowStream", counting_stream)
    monkeypatch.setattr(table_client, "unary", counting_unary)
    client._drop_stream(0), client._drop_stream(1)
    ids = torch.tensor([3, 4, 9])
    for step in range(1, 6):
        client.pull(cfg, ids)
        client.push(cfg, ids, torch.ones(3, 3), lr=0.5, step=step, defer=step % 2 == 0)
    client.flush()
    assert (len(opened), unary_calls) == (2, [])  # one stream per ps task, reused
    torch.testing.assert_close(client.pull(cfg, ids), before[ids] - 2.5)


def test_a_push_whose_stream_reply_is_lost_is_sent_again_and_applied_once(cluster, monkeypatch):
    import towerflow.ps.worker.tables.client as table_client
    from towerflow.errors import UnavailableError

    _, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    lost = []

    class LosingStream(table_client.RowStream):
        __slots__ = ()

        def receive(self):
            reply = super().receive()  # the ps applied the push; its answer never arrives
            if not lost:
                lost.append(reply)
                raise UnavailableError("connection reset (test)")
            return reply

    monkeypatch.setattr(table_client, "RowStream", LosingStream)
    client._drop_stream(0), client._drop_stream(1)
    replies = client.push(cfg, torch.tensor([4]), torch.ones(1, 3), lr=0.5, step=1)
    assert [(r.status, r.duplicate, r.applied) for r in replies] == [("applied", True, 1)]
    assert unframe(lost[0])[0].items[0].push.duplicate is False
    torch.testing.assert_close(table_rows(client, cfg)[4], before[4] - 0.5)
    assert client.status(cfg, 0).applied == 1


def test_a_refused_request_ends_its_stream_and_the_next_one_opens_another(cluster):
    _, client = cluster
    cfg = config()
    client.init_table(cfg)
    with pytest.raises(InvalidArgumentError, match=r"row gradients of id 2 hold \[nan"):
        client.push(cfg, torch.tensor([2]), torch.full((1, 3), float("nan")), lr=0.5, step=1)
    assert client._streams[0] is None
    torch.testing.assert_close(client.pull(cfg, torch.tensor([2])), expected_rows(torch.tensor([2])))
