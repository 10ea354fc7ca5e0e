"""A table shard's push records are bounded: the job's current workers only, dropped when
no retry of theirs can arrive, and only the live ones checkpointed.

The ps task is a real ``Server`` on 127.0.0.1 hosting its dense shard and its
tables (``JOB_SERVICES["ps"]``), in this process, with authenticated gRPC; the
cluster has two replicas (worker 0 and 1).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.cluster import ClusterSpec, Server
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.server.tables.records import MAX_PUSHES_IN_FLIGHT, JobWorkers
from towerflow.ps.server.tables.shard import TableShard
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.calls import ELASTIC_BASE
from towerflow.ps.wire.tables import table_spec
from towerflow.ps.worker.dense.variables import join_job
from towerflow.ps.worker.tables.checkpoint import TABLES_GROUP, export_tables
from towerflow.ps.worker.tables.client import TableClient
from towerflow.testing.ledger import audit_ledger

SECRET = Credentials(secret=b"table-records-secret")
REPLICAS = 2


class Task:
    """One ps task (dense shard and tables) of a cluster of ``REPLICAS`` workers."""

    def __init__(self, free_ports) -> None:
        ports = free_ports(1 + REPLICAS)
        self.spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                                 "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
        self.server = Server(self.spec, "ps", 0, credentials=SECRET)
        self.channel = make_channel(self.spec.task_address("ps", 0), SECRET)
        self.tables = self.server_service("TableHost")

    def server_service(self, kind: str):  # type: ignore[no-untyped-def]
        (hosted,) = [s for s in self.server.services if type(s).__name__ == kind]
        return hosted.service

    def call(self, method: str, request, reply):  # type: ignore[no-untyped-def]
        data = unary(self.channel, f"/towerflow.ps.Tables/{method}",
                     request.SerializeToString(), timeout=10)
        return reply.FromString(data)

    def push(self, worker: int, seq: int = 1, incarnation: int = 1, ids=(), table: str = "t",
             lr: float = 1.0) -> tpb.PushRowsReply:
        dim = 1
        return self.call("PushRows", tpb.PushRowsRequest(
            table=table, shard=0, worker_id=worker, incarnation=incarnation, seq=seq, lr=lr,
            step=1, num_ids=len(ids), dtype="float32",
            ids=np.asarray(ids, np.int64).tobytes(),
            grads=np.ones((len(ids), dim), np.float32).tobytes()), tpb.PushRowsReply)

    def done(self, worker: int) -> None:
        self.call("Done", tpb.TablesDoneRequest(worker_id=worker), tpb.TablesDoneReply)

    def records(self, table: str = "t") -> list[int]:
        """The worker ids of the table shard's push records (as ``TableStatus`` reports them)."""
        return [p.worker_id for p in self.status(table)[0].pushes]

    def rows(self, table: str, count: int) -> np.ndarray:
        data = self.call("PullRows", tpb.PullRowsRequest(
            table=table, shard=0, num_ids=count, ids=np.arange(count, dtype=np.int64).tobytes()),
            tpb.PullRowsReply)
        return np.frombuffer(data.rows, np.float32).copy()

    def status(self, table: str = "t") -> tuple[tpb.TableStatusReply, int]:
        data = unary(self.channel, "/towerflow.ps.Tables/TableStatus",
                     tpb.TableStatusRequest(table=table, shard=0).SerializeToString(), timeout=10)
        return tpb.TableStatusReply.FromString(data), len(data)

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


def table(rows: int = 64, name: str = "t") -> TableConfig:
    return TableConfig(name, ModPartitioner(1, num_rows=rows), 1, {"name": "sgd", "hyper": {}},
                       {"kind": "constant", "value": 0.0})


@pytest.fixture
def task(free_ports):
    task = Task(free_ports)
    client = TableClient(task.spec.job_tasks("ps"), credentials=SECRET, worker_id=0,
                         timeout=10.0)
    try:
        client.init_table(table())  # async: the client sends no aggregation
        yield task
    finally:
        client._close()
        task.close()


def test_3000_worker_ids_are_refused_beyond_the_jobs_workers_and_records_stay_bounded(task):
    refused = []
    for worker in range(3000):
        try:
            assert task.push(worker).status == "applied"
        except InvalidArgumentError as exc:
            refused.append((worker, str(exc)))
    status, size = task.status()
    print(f"records {len(status.pushes)}, TableStatus reply {size} bytes, "
          f"refused {len(refused)}")
    assert [p.worker_id for p in status.pushes] == list(range(REPLICAS))
    assert [w for w, _ in refused] == list(range(REPLICAS, 3000))
    assert status.applied == REPLICAS and size < 512
    worker, message = refused[0]
    assert message.count(". ") <= 2 and len(message) < 400, message
    assert f"A push to table 't' from worker {worker} was refused: the workers of this job " \
        f"are its replicas 0 .. {REPLICAS - 1}" in message, message


# --------------------------------------------------------------------------- churn
ROUNDS, PUSHES = 50, 3


@pytest.fixture
def job(free_ports):
    """The ps task with its dense shard initialised by the chief (async, one elastic worker
    at a time) and two tables: ``e`` (the elastic workers') and ``r`` (a restarted replica's)."""
    task = Task(free_ports)
    placement = plan_placement({"w": (4,)}, 1)
    chief = PSClient(task.spec, placement, worker_id=0, credentials=SECRET, timeout=10.0)
    tables = TableClient(task.spec.job_tasks("ps"), credentials=SECRET, worker_id=0,
                         timeout=10.0)
    try:
        chief.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                         aggregation=AggregationConfig(total_num_replicas=REPLICAS,
                                                       max_elastic_workers=1))
        for name, rows in (("e", ROUNDS * PUSHES), ("r", ROUNDS)):
            tables.init_table(table(rows, name))
        task.placement = placement
        task.tables_client = tables
        yield task
    finally:
        tables._close()
        chief.close(done=False)
        task.close()


def test_an_elastic_worker_that_leaves_and_joins_50_times_keeps_records_bounded_and_exact(job):
    """Each round an elastic worker joins (a new id), pushes, retries each push (its reply
    lost), says Done, and retries its last push: records stay at the live workers, and the
    ledger of the table's rows has every push once."""
    journals: dict[int, list[str]] = {}
    ids = []
    for round_ in range(ROUNDS):
        member = PSClient(job.spec, job.placement, worker_id=-1, credentials=SECRET,
                          timeout=10.0)
        worker, _ = join_job(member, f"spare:{round_}")
        ids.append(worker)
        lines = journals[round_] = []
        for n in range(PUSHES):
            lines.append(f"push {n}")
            row, seq = round_ * PUSHES + n, n + 1
            first = job.push(worker, seq, member.incarnation, [row], table="e")
            again = job.push(worker, seq, member.incarnation, [row], table="e")  # reply lost
            assert (first.duplicate, again.duplicate, again.status) == (False, True, "applied")
            if n < PUSHES - 1:  # the last push's answer never reaches the worker: in flight
                lines.append(f"applied {n}")
        assert set(job.records("e")) == {worker}  # the live elastic worker only
        job.done(worker)  # the tables' Done, then the ps's (with its ticket: it leaves)
        member.close(done=True)
        assert job.records("e") == []  # dropped: no retry of it can be applied any more
        with pytest.raises(InvalidArgumentError, match=rf"from worker {worker} was refused"):
            job.push(worker, PUSHES, member.incarnation, [round_ * PUSHES + PUSHES - 1],
                     table="e")
    assert ids == list(range(ELASTIC_BASE, ELASTIC_BASE + ROUNDS))  # a new id each time
    rows = job.rows("e", ROUNDS * PUSHES)
    audit = audit_ledger(rows, journals, slots=PUSHES)
    assert audit.consistent and (audit.lost, audit.applied_twice, audit.unexpected) == (0, 0, 0)
    assert (audit.acknowledged, audit.in_flight, audit.in_flight_applied) == \
        (ROUNDS * (PUSHES - 1), ROUNDS, ROUNDS)
    assert job.status("e")[0].applied == ROUNDS * PUSHES


def test_a_replica_restarted_50_times_keeps_one_record_and_refuses_its_old_incarnations(job):
    """Replica 1 restarts 50 times (a newer incarnation each time); the retry of the old
    incarnation's last push arrives after the new one's first push and is refused."""
    lines: list[str] = []
    previous = None
    base = time.time_ns()
    for n in range(ROUNDS):
        incarnation = base + n
        lines += [f"incarnation {incarnation}", f"push {n}"]
        assert not job.push(1, 1, incarnation, [n], table="r").duplicate
        lines.append(f"applied {n}")
        if previous is not None:  # the old incarnation's retry: refused, not applied again
            with pytest.raises(FailedPreconditionError, match=r"superseded by incarnation"):
                job.push(1, 1, previous, [n - 1], table="r")
        previous = incarnation
        assert job.records("r") == [1]
        assert [p.incarnation for p in job.status("r")[0].pushes] == [incarnation]
    audit = audit_ledger(job.rows("r", ROUNDS), {0: lines}, slots=ROUNDS)
    assert audit.consistent and audit.acknowledged == ROUNDS and audit.applied_twice == 0


def test_a_checkpoint_taken_after_churn_holds_only_live_records(job, tmp_path):
    for round_ in range(5):  # four elastic workers join and leave; the fifth stays
        member = PSClient(job.spec, job.placement, worker_id=-1, credentials=SECRET,
                          timeout=10.0)
        worker, _ = join_job(member, f"spare:{round_}")
        assert job.push(worker, 1, member.incarnation, [round_], table="e").status == "applied"
        if round_ < 4:
            member.close(done=True)
    for replica in range(REPLICAS):
        job.push(replica, 1, 7, [replica], table="e")
    manager = CheckpointManager(tmp_path / "run")
    cfg = table(ROUNDS * PUSHES, "e")
    path = manager.save(1, {"model": {"w": torch.zeros(4)},
                            TABLES_GROUP: export_tables(job.tables_client, [cfg])})
    infos = read_checkpoint(path).chunked[TABLES_GROUP].infos
    records = [r for info in infos for r in info.get("pushes", ())]
    assert sorted(r[0] for r in records) == [0, 1, worker]  # the four that left: dropped
    member.close(done=True)
    assert job.records("e") == [0, 1]


def test_an_import_takes_in_the_records_of_the_jobs_workers_only():
    shard = TableShard(table_spec(table(), 0), workers=JobWorkers(replicas=REPLICAS))
    records = [pb.PushRecord(worker_id=w, incarnation=1, seq=3, status="applied")
               for w in (0, 1, 2, 5000, ELASTIC_BASE)]
    chunk = tpb.RowChunk(pushes=records, num_ids=1, ids=np.array([3], np.int64).tobytes(),
                         rows=np.ones(1, np.float32).tobytes())
    assert shard.import_chunks([chunk]) == 1
    assert [row[0] for row in shard.status()["pushes"]] == [0, 1]


def sync_push(shard: TableShard, worker: int, seq: int, incarnation: int = 1):  # type: ignore[no-untyped-def]
    request = tpb.PushRowsRequest(table="t", shard=0, worker_id=worker, incarnation=incarnation,
                                  seq=seq, lr=1.0, step=1, num_ids=0, dtype="float32")
    return shard.push(request, lambda: False)  # its call has ended: it stops waiting at once


def test_pushes_in_progress_are_bounded_per_worker_and_per_step():
    """A replica that sends sync pushes and drops their calls leaves them counted in the
    step (their retries wait for it): at most MAX_PUSHES_IN_FLIGHT each, and per step."""
    config = AggregationConfig(mode="sync", total_num_replicas=REPLICAS, timeout=5.0)
    shard = TableShard(table_spec(table(), 0), config)
    for seq in range(1, MAX_PUSHES_IN_FLIGHT + 1):
        with pytest.raises(DeadlineExceededError):
            sync_push(shard, 0, seq)
    with pytest.raises(ResourceExhaustedError, match=rf"push {MAX_PUSHES_IN_FLIGHT + 1} of "
                                                     rf"worker 0 was refused: it has "
                                                     rf"{MAX_PUSHES_IN_FLIGHT} pushes in progress"):
        sync_push(shard, 0, MAX_PUSHES_IN_FLIGHT + 1)
    for incarnation in range(2, 2 + MAX_PUSHES_IN_FLIGHT):  # new incarnations: one row each
        with pytest.raises(DeadlineExceededError):
            sync_push(shard, 0, 1, incarnation)
    with pytest.raises(ResourceExhaustedError, match=r"holds 128 pushes waiting, the most for "
                                                     r"2 replicas"):
        sync_push(shard, 1, 1)
    assert len(shard.status()["pushes"]) == 1
