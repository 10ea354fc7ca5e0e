"""A fixed table shard's live replica on the next ps task (``replicas=1``): two whole ps tasks
(dense and table services) served from this process, authenticated gRPC on 127.0.0.1.

Table shard 0's copy lives on ps task 1 and shard 1's on ps task 0, under the term of the
task's shard (one with the dense shard's).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import replica_calls as calls
import torch

from towerflow.cluster import Server, ServerOptions
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import FailedPreconditionError, UnavailableError
from towerflow.ps import AggregationConfig
from towerflow.ps.partition import HashPartitioner, ModPartitioner
from towerflow.ps.server.tables.service import TableHost
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.testing.faults import loopback_cluster, wait_until

SECRET = Credentials(secret=b"table-replicas-secret")
INIT = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 3}
ADAGRAD = {"name": "adagrad", "hyper": {"initial_accumulator_value": 0.1, "epsilon": 1e-8}}
TABLE = TableConfig("t", ModPartitioner(2, num_rows=20), 3, ADAGRAD, INIT)


@pytest.fixture
def servers():
    """The ps task servers a test starts (in order), all stopped at its end."""
    started: list[Server] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def replicated(servers):
    """Two whole ps tasks (``servers``) and a worker's table client asking ``replicas=1``
    -> (spec, table services, client). Everything started is closed at the end."""
    spec = loopback_cluster(2, 1)
    servers.extend(Server(spec, "ps", i, credentials=SECRET,
                          options=ServerOptions(serve_forever=True)) for i in range(2))
    client = TableClient(spec.job_tasks("ps"), credentials=SECRET, worker_id=0,
                         incarnation=100, timeout=10.0, aggregation=AggregationConfig(replicas=1))
    try:
        tables = [next(h for h in s.services if isinstance(h, TableHost)).service
                  for s in servers]
        yield spec, tables, client
    finally:
        client._close()


def ps_call(spec: Any, task: int, call: Any, *args: Any, **kw: Any) -> Any:
    channel = make_channel(spec.task_address("ps", task), SECRET)
    try:
        return call(channel, *args, **kw)
    finally:
        channel.close()


def table_call(spec: Any, task: int, method: str, request: Any) -> bytes:
    return ps_call(spec, task, unary, f"/towerflow.ps.Tables/{method}",
                   request.SerializeToString(), timeout=10.0)


def push_rows(spec: Any, task: int, *, shard: int, seq: int, ids: list[int]) -> Any:
    grads = torch.ones(len(ids), 3)
    request = tpb.PushRowsRequest(table="t", shard=shard, worker_id=0, incarnation=100,
                                  seq=seq, lr=0.5, step=seq, num_ids=len(ids), dtype="float32",
                                  ids=torch.tensor(ids).numpy().tobytes(),
                                  grads=grads.numpy().tobytes())
    return tpb.PushRowsReply.FromString(table_call(spec, task, "PushRows", request))


def pull_rows(spec: Any, task: int, *, shard: int, ids: list[int]) -> torch.Tensor:
    request = tpb.PullRowsRequest(table="t", shard=shard, num_ids=len(ids),
                                  ids=torch.tensor(ids).numpy().tobytes())
    reply = tpb.PullRowsReply.FromString(table_call(spec, task, "PullRows", request))
    return torch.frombuffer(bytearray(reply.rows), dtype=torch.float32).reshape(len(ids), 3)


def assert_same_rows(primary: Any, copy: Any) -> None:
    a, b = primary.store.export(), copy.store.export()
    assert torch.equal(a.ids, b.ids) and torch.equal(a.rows, b.rows)
    assert list(a.slots) == list(b.slots) and a.slots
    for name in a.slots:
        assert torch.equal(a.slots[name], b.slots[name])
    with primary.cond, copy.cond:
        assert primary.live_records() == copy.live_records()


def test_rows_a_push_changed_are_on_the_replica_with_their_slots_and_records(
        replicated) -> None:
    spec, tables, client = replicated
    assert [r.created for r in client.init_table(TABLE)] == [True, True]
    pairs = [(tables[0].table("t", 0), tables[1]._copies.get("t", 0)),
             (tables[1].table("t", 1), tables[0]._copies.get("t", 1))]
    for primary, copy in pairs:  # the table and every row, before InitTable answered
        assert_same_rows(primary, copy)
    for step in range(1, 4):
        ids = torch.tensor([step, 7, 12, 19 - step])
        client.push(TABLE, ids, torch.full((4, 3), 0.1 * step), lr=0.5, step=step)
        for primary, copy in pairs:  # answered: the replica holds it already
            assert_same_rows(primary, copy)
    before = pairs[0][0].store.export()
    assert not torch.equal(before.slots[next(iter(before.slots))],
                           torch.full_like(before.rows, 0.1))  # the slots moved


def test_a_shard_larger_than_a_copy_part_reaches_the_replica_whole_part_by_part(
        replicated, monkeypatch) -> None:
    from towerflow.ps.server.tables import replica

    monkeypatch.setattr(replica, "COPY_CHUNK_ROWS", 4)  # 10 rows a shard: parts of 4, 4, 2
    sent = []
    call = replica.CopyStream.call
    monkeypatch.setattr(replica.CopyStream, "call",
                        lambda self, chunk: (sent.append(len(chunk)), call(self, chunk))[1])
    spec, tables, client = replicated
    client.init_table(TABLE)
    assert len(sent) == 6  # 3 parts for each of the 2 shards, one call each
    pairs = [(tables[0].table("t", 0), tables[1]._copies.get("t", 0)),
             (tables[1].table("t", 1), tables[0]._copies.get("t", 1))]
    for primary, copy in pairs:
        assert_same_rows(primary, copy)
    client.push(TABLE, torch.tensor([1, 2, 18]), torch.full((3, 3), 0.3), lr=0.5, step=1)
    for primary, copy in pairs:
        assert_same_rows(primary, copy)


def test_a_promoted_table_copy_serves_rows_and_a_resent_push_applies_once(replicated) -> None:
    spec, tables, client = replicated
    client.init_table(TABLE)
    assert push_rows(spec, 0, shard=0, seq=1, ids=[0, 4]).status == "applied"
    before = pull_rows(spec, 0, shard=0, ids=[0, 4, 8])
    assert ps_call(spec, 1, calls.promote, 0).term == 2
    assert torch.equal(pull_rows(spec, 1, shard=0, ids=[0, 4, 8]), before)
    again = push_rows(spec, 1, shard=0, seq=1, ids=[0, 4])  # the push in flight, sent again
    assert again.status == "applied" and again.duplicate
    assert torch.equal(pull_rows(spec, 1, shard=0, ids=[0, 4, 8]), before)
    fresh = push_rows(spec, 1, shard=0, seq=2, ids=[8])
    assert fresh.status == "applied" and not fresh.duplicate
    after = pull_rows(spec, 1, shard=0, ids=[0, 4, 8])
    assert torch.equal(after[:2], before[:2]) and not torch.equal(after[2], before[2])


def test_the_stale_primary_refuses_table_pushes_and_pulls_after_the_promotion(
        replicated) -> None:
    spec, tables, client = replicated
    client.init_table(TABLE)
    ps_call(spec, 1, calls.promote, 0)
    kept = tables[1]._copies.get("t", 0).store.export().rows
    with pytest.raises(FailedPreconditionError, match=re.escape(
            "ps task 0 is no longer the primary of shard 0 (term 1, now term 2 on ps task 1)")):
        push_rows(spec, 0, shard=0, seq=1, ids=[2])
    assert torch.equal(tables[1]._copies.get("t", 0).store.export().rows, kept)
    with pytest.raises(FailedPreconditionError, match="no longer the primary of shard 0"):
        pull_rows(spec, 0, shard=0, ids=[2])
    with pytest.raises(FailedPreconditionError, match=re.escape(
            "ps task 0 holds only a replica of shard 1 (term 1)")):
        pull_rows(spec, 0, shard=1, ids=[1])  # ps task 0 holds a copy of shard 1 only
    assert push_rows(spec, 1, shard=1, seq=1, ids=[1]).status == "applied"


def _dynamic_state(store: Any) -> tuple:
    """A dynamic row store's rows, slots, versions and admission counters, by id."""
    export = store.export()
    counters = store.export_counters()
    return (export.ids.tolist(), export.rows.tolist(),
            {k: v.tolist() for k, v in export.slots.items()}, export.versions.tolist(),
            counters[0].tolist(), counters[1].tolist())


def test_a_dynamic_tables_copy_follows_admission_updates_and_eviction(replicated) -> None:
    spec, tables, client = replicated
    dynamic = TableConfig("d", HashPartitioner(2), 3, ADAGRAD, INIT,
                          store={"kind": "dynamic", "admit_after": 2, "evict_after_steps": 2,
                                 "capacity": None})
    client.init_table(dynamic)
    seen = set()
    for step, ids in enumerate([[1, 2, 3, 4], [1, 2, 5], [1, 6, 7], [6, 7, 8], [8, 9, 1],
                                [9, 10, 11], [2, 3, 4], [3, 4, 12]], start=1):
        replies = client.push(dynamic, torch.tensor(ids), torch.ones(len(ids), 3), lr=0.5,
                              step=step)
        assert all(r.status == "applied" for r in replies)
        for shard in (0, 1):  # acknowledged: each copy is its primary's, row for row
            primary = tables[shard]._tables[("d", shard)].store
            copy = tables[1 - shard]._copies.get("d", shard).store
            assert _dynamic_state(copy) == _dynamic_state(primary), (step, shard)
            seen.update(primary.export().ids.tolist())
    stats = [tables[s]._tables[("d", s)].store.counters for s in (0, 1)]
    assert sum(c["evicted"] for c in stats) and sum(c["filtered"] for c in stats)  # both ran
    wanted = torch.tensor(sorted(seen))
    before = client.pull(dynamic, wanted)
    ps_call(spec, 1, calls.promote, 0)  # shard 0's copy serves it now: the same rows
    assert ps_call(spec, 1, calls.promote, 0).term == 2
    moved = TableClient(spec.job_tasks("ps"), credentials=SECRET, worker_id=0, incarnation=101,
                        timeout=10.0, aggregation=AggregationConfig(replicas=1))
    try:
        moved._routing.routes[0].task, moved._routing.routes[0].term = 1, 2
        assert torch.equal(moved.pull(dynamic, wanted), before)
    finally:
        moved._close()


def test_a_restarted_replica_task_gets_the_table_and_every_row_again_once_it_answers(
        replicated, servers) -> None:
    spec, tables, client = replicated
    client.init_table(TABLE)
    assert push_rows(spec, 0, shard=0, seq=1, ids=[0, 4]).status == "applied"
    servers[1].stop()  # ps task 1, shard 0's replica, ends; a new one starts in its place
    servers.append(Server(spec, "ps", 1, credentials=SECRET,
                          options=ServerOptions(serve_forever=True)))
    copies = next(h for h in servers[-1].services if isinstance(h, TableHost)).service
    assert copies._copies is None
    assert push_rows(spec, 0, shard=0, seq=2, ids=[6]).status == "applied"  # alone
    wait_until(lambda: copies._copies is not None and copies._copies.get("t", 0) is not None
               and not tables[0].terms.of(0).alone, timeout=20,
               what="the new task caught up")  # the task's Rejoin copies the shard to it
    assert_same_rows(tables[0].table("t", 0), copies._copies.get("t", 0))
    assert push_rows(spec, 0, shard=0, seq=3, ids=[6, 8]).status == "applied"
    assert_same_rows(tables[0].table("t", 0), copies._copies.get("t", 0))


def test_a_table_push_is_not_acknowledged_while_the_replica_is_unreachable(
        replicated, servers) -> None:
    spec, tables, client = replicated
    client.init_table(TABLE)
    servers[1].stop()  # ps task 1 holds table shard 0's copy
    with pytest.raises(UnavailableError, match=re.escape(
            "ps task 0 applied the push to shard 0, but its replica on ps task 1 did not "
            "acknowledge the copy")) as info:
        push_rows(spec, 0, shard=0, seq=1, ids=[2])
    assert "the push is not acknowledged" in str(info.value)


def test_a_sync_step_of_rows_is_on_the_replica_and_its_copy_hears_a_worker_done(
        servers) -> None:
    spec = loopback_cluster(2, 2)
    servers.extend(Server(spec, "ps", i, credentials=SECRET,
                          options=ServerOptions(serve_forever=True)) for i in range(2))
    sync = AggregationConfig(mode="sync", total_num_replicas=2, replicas=1)
    clients = [TableClient(spec.job_tasks("ps"), credentials=SECRET, worker_id=w,
                           incarnation=100 + w, timeout=10.0, aggregation=sync)
               for w in range(2)]
    pool = ThreadPoolExecutor(1)
    try:
        tables = [next(h for h in s.services if isinstance(h, TableHost)).service
                  for s in servers]
        clients[0].init_table(TABLE)
        primary, copy = tables[0].table("t", 0), tables[1]._copies.get("t", 0)
        ids = torch.tensor([0, 2, 4])
        first = pool.submit(clients[0].push, TABLE, ids, torch.full((3, 3), 0.25), lr=0.5,
                            step=1)
        replies = clients[1].push(TABLE, ids, torch.full((3, 3), 0.75), lr=0.5, step=1)
        assert {r.status for r in [*replies, *first.result(timeout=10)]} == {"applied"}
        assert_same_rows(primary, copy)  # the step's averaged update, before the answers
        clients[1].done()  # to every ps task: the copies held there hear it too
        assert ps_call(spec, 1, calls.promote, 0).term == 2
        before = pull_rows(spec, 1, shard=0, ids=[0])
        reply = push_rows(spec, 1, shard=0, seq=2, ids=[0])  # worker 0 alone: 1 is done
        assert reply.status == "applied"
        assert not torch.equal(pull_rows(spec, 1, shard=0, ids=[0]), before)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for client in clients:
            client._close()
