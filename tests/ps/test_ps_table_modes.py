"""Sync and bounded-staleness (ssp) aggregation of sparse row pushes, on real ps servers.

ps tasks are real ``Server``s on 127.0.0.1 serving the table service with
authenticated gRPC; each worker is a ``TableClient`` (threads of this process)
or, for the strategy's runs, a child process of tests/support/programs/sparse_click.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import DeadlineExceededError, InvalidArgumentError
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.tables.client import TableClient

SECRET = Credentials(secret=b"modes-secret")
CONSTANT = {"kind": "constant", "value": 1.0}


def table(num_rows: int = 20, dim: int = 2) -> TableConfig:
    return TableConfig("t", ModPartitioner(2, num_rows=num_rows), dim,
                       {"name": "sgd", "hyper": {}}, CONSTANT)


@pytest.fixture
def ps_tasks(table_ps_tasks):
    """Two ps tasks serving the table service; ``clients(count, aggregation=None)``."""
    return table_ps_tasks(SECRET)


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a thread; its result or exception lands in the returned dict."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def still_waiting(thread: threading.Thread, seconds: float = 0.5) -> bool:
    thread.join(seconds)
    return thread.is_alive()


def finished(thread: threading.Thread, out: dict):
    thread.join(20)
    assert not thread.is_alive(), "the push did not return"
    if "error" in out:
        raise out["error"]
    return out["result"]


def rows_of(client: TableClient, cfg: TableConfig, ids) -> torch.Tensor:
    return client.pull(cfg, torch.tensor(ids))


# --------------------------------------------------------------------------- sync
SYNC = AggregationConfig(mode="sync", total_num_replicas=2, timeout=20.0)


def test_sync_averages_each_row_over_the_replicas_that_pushed_it_and_applies_once(ps_tasks):
    spec, clients = ps_tasks
    w0, w1, reader = clients(2, SYNC) + clients(1)
    cfg = table()
    w0.init_table(cfg)
    g0 = torch.tensor([[2.0, 4.0], [1.0, 1.0]])  # rows 4 and 6
    g1 = torch.tensor([[6.0, 0.0], [3.0, 3.0]])  # rows 4 and 8
    first, out0 = in_thread(w0.push, cfg, torch.tensor([4, 6]), g0, lr=0.5, step=1)
    assert still_waiting(first)  # its step needs the other replica
    torch.testing.assert_close(rows_of(reader, cfg, [4, 6, 8]), torch.ones(3, 2))
    replies = w1.push(cfg, torch.tensor([4, 8]), g1, lr=0.5, step=1)
    assert [(r.status, r.applied) for r in replies] == [("applied", 1), ("applied", 1)]
    assert [(r.status, r.applied) for r in finished(first, out0)] == [("applied", 1)] * 2
    expected = torch.ones(3, 2)
    expected[0] -= 0.5 * (g0[0] + g1[0]) / 2  # both replicas: their average
    expected[1] -= 0.5 * g0[1]  # one replica: its own gradient (averaged over one)
    expected[2] -= 0.5 * g1[1]
    torch.testing.assert_close(rows_of(reader, cfg, [4, 6, 8]), expected)
    statuses = [reader.status(cfg, s) for s in range(2)]
    assert [(s.applied, s.sync_step) for s in statuses] == [(1, 1), (1, 1)]  # one update


def test_a_retried_sync_push_is_counted_once_and_answered_with_the_step(ps_tasks):
    spec, clients = ps_tasks
    chief, reader = clients(1, SYNC)[0], clients(1)[0]
    cfg = table()
    chief.init_table(cfg)

    def push(worker: int, ids: list[int], grads: list[list[float]]) -> tpb.PushRowsRequest:
        return tpb.PushRowsRequest(
            table="t", shard=0, worker_id=worker, incarnation=7, seq=1, lr=1.0, step=1,
            num_ids=len(ids), dtype="float32",
            ids=torch.tensor(ids, dtype=torch.int64).numpy().tobytes(),
            grads=torch.tensor(grads).numpy().tobytes())

    def send(request: tpb.PushRowsRequest) -> tpb.PushRowsReply:
        channel = make_channel(spec.task_address("ps", 0), SECRET)
        try:
            data = unary(channel, "/towerflow.ps.Tables/PushRows", request.SerializeToString(),
                         timeout=20)
            return tpb.PushRowsReply.FromString(data)
        finally:
            channel.close()

    mine = push(0, [2], [[4.0, 8.0]])
    first, out_first = in_thread(send, mine)
    assert still_waiting(first)
    retry, out_retry = in_thread(send, mine)  # the same (worker, incarnation, seq) again
    assert still_waiting(retry, 0.3)
    other = send(push(1, [2, 4], [[2.0, 2.0], [1.0, 1.0]]))
    answers = [finished(first, out_first), finished(retry, out_retry)]
    assert sorted((a.status, a.duplicate, a.applied) for a in [*answers, other]) == [
        ("applied", False, 1), ("applied", False, 1), ("applied", True, 1)]
    # worker 0's gradient counted once: (4 + 2) / 2 and (8 + 2) / 2, not (2 * 4 + 2) / 2
    torch.testing.assert_close(rows_of(reader, cfg, [2]), torch.tensor([[1.0 - 3.0, 1.0 - 5.0]]))
    assert reader.status(cfg, 0).applied == 1


def test_a_sync_push_of_an_older_step_is_stale_and_not_applied(ps_tasks):
    _, clients = ps_tasks
    w0, w1 = clients(2, SYNC)
    cfg = table()
    w0.init_table(cfg)
    thread, out = in_thread(w0.push, cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)
    w1.push(cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)
    finished(thread, out)
    before = rows_of(w1, cfg, [4])
    late = w0.push(cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)  # step 0 again
    assert [r.status for r in late] == ["stale", "stale"]
    assert "computed on step 0 but table 't' aggregates step 1" in late[0].message
    torch.testing.assert_close(rows_of(w1, cfg, [4]), before, rtol=0, atol=0)


def test_with_a_backup_worker_the_step_applies_with_the_first_replicas_and_the_late_is_stale(
        ps_tasks):
    _, clients = ps_tasks
    backup = AggregationConfig(mode="sync", total_num_replicas=3, replicas_to_aggregate=2,
                               timeout=20.0)
    w0, w1, w2 = clients(3, backup)
    cfg = table()
    w0.init_table(cfg)
    thread, out = in_thread(w0.push, cfg, torch.tensor([4]), torch.full((1, 2), 2.0), lr=1.0,
                            step=1)
    w1.push(cfg, torch.tensor([4]), torch.full((1, 2), 4.0), lr=1.0, step=1)
    finished(thread, out)
    torch.testing.assert_close(rows_of(w2, cfg, [4]), torch.full((1, 2), 1.0 - 3.0))
    late = w2.push(cfg, torch.tensor([4]), torch.full((1, 2), 8.0), lr=1.0, step=1)
    assert [r.status for r in late] == ["stale", "stale"]
    torch.testing.assert_close(rows_of(w2, cfg, [4]), torch.full((1, 2), 1.0 - 3.0))
    assert [w2.status(cfg, s).applied for s in range(2)] == [1, 1]


def test_a_worker_that_says_it_is_done_no_longer_holds_the_sync_step(ps_tasks):
    _, clients = ps_tasks
    w0, w1 = clients(2, SYNC)
    cfg = table()
    w0.init_table(cfg)
    thread, out = in_thread(w0.push, cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)
    assert still_waiting(thread)
    w1.done()
    assert [r.status for r in finished(thread, out)] == ["applied", "applied"]
    torch.testing.assert_close(rows_of(w0, cfg, [4]), torch.zeros(1, 2))


def test_a_sync_step_missing_a_worker_times_out_naming_it(ps_tasks):
    _, clients = ps_tasks
    quick = AggregationConfig(mode="sync", total_num_replicas=2, timeout=0.5)
    w0 = clients(1, quick)[0]
    cfg = table()
    w0.init_table(cfg)
    w0.retries = 0
    with pytest.raises(DeadlineExceededError, match=r"Step 0 of table 't' shard \d waited 0.5 s "
                                                    r"for 2 replicas.*missing: worker 1"):
        w0.push(cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)


def test_a_push_from_a_worker_outside_the_replicas_is_refused_and_changes_nothing(ps_tasks):
    _, clients = ps_tasks
    w0 = clients(1, SYNC)[0]
    cfg = table()
    w0.init_table(cfg)
    w0.worker_id = 5
    with pytest.raises(InvalidArgumentError, match=r"from worker 5 was refused: the replicas of "
                                                   r"this job are 0 \.\. 1"):
        w0.push(cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)
    torch.testing.assert_close(rows_of(w0, cfg, [4]), torch.ones(1, 2), rtol=0, atol=0)


# --------------------------------------------------------------------------- ssp
def test_ssp_applies_on_arrival_but_holds_a_worker_staleness_pushes_ahead(ps_tasks):
    _, clients = ps_tasks
    ssp = AggregationConfig(mode="ssp", total_num_replicas=2, staleness=1, timeout=20.0)
    w0, w1 = clients(2, ssp)
    cfg = table()
    w0.init_table(cfg)
    ids, grads = torch.tensor([4]), torch.ones(1, 2)
    w0.push(cfg, ids, grads, lr=1.0, step=1)  # one ahead of worker 1: within the bound
    ahead, out = in_thread(w0.push, cfg, ids, grads, lr=1.0, step=2)
    assert still_waiting(ahead)  # two ahead: held until worker 1 pushes
    torch.testing.assert_close(rows_of(w1, cfg, [4]), -torch.ones(1, 2))  # applied on arrival
    w1.push(cfg, torch.tensor([6]), grads, lr=1.0, step=1)
    finished(ahead, out)
    statuses = [w1.status(cfg, s) for s in range(2)]
    assert [s.max_lead for s in statuses] == [1, 1]  # never more than staleness ahead
    third, out = in_thread(w0.push, cfg, ids, grads, lr=1.0, step=3)
    assert still_waiting(third)
    w1.done()  # a finished worker no longer holds the others back
    finished(third, out)


def test_init_table_refuses_another_aggregation_for_a_table_that_exists(ps_tasks):
    _, clients = ps_tasks
    sync0 = clients(1, SYNC)[0]
    async0 = clients(1)[0]
    sync0.init_table(table())
    from towerflow.errors import FailedPreconditionError

    with pytest.raises(FailedPreconditionError, match=r"exists as .*mode='sync'.* cannot become"):
        async0.init_table(table())


def test_every_step_of_a_sync_worker_pushes_to_every_shard(ps_tasks):
    _, clients = ps_tasks
    w0, w1 = clients(2, SYNC)
    cfg = table()
    w0.init_table(cfg)
    start = time.monotonic()
    thread, out = in_thread(w0.push, cfg, torch.tensor([4]), torch.ones(1, 2), lr=1.0, step=1)
    replies = w1.push(cfg, torch.tensor([6]), torch.ones(1, 2), lr=1.0, step=1)  # shard 0 only
    assert len(replies) == 2 and len(finished(thread, out)) == 2  # empty pushes to shard 1
    assert [w0.status(cfg, s).applied for s in range(2)] == [1, 1]
    assert time.monotonic() - start < 10


# --------------------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "defer"), [("sync", False), ("sync", True), ("ssp", False)])
def test_two_workers_train_a_table_in_sync_and_ssp_modes(free_ports, subprocess_env, tmp_path,
                                                         mode, defer):
    from test_ps_tables import _run_cluster

    steps = 40
    extra = ("--mode", mode, *(("--defer",) if defer else ()))
    reports = _run_cluster(free_ports, subprocess_env, tmp_path, num_rows=5000, steps=steps,
                           extra=extra)
    for report in reports:
        if mode == "sync":  # 2 workers, 1 update a step on every shard
            assert report["table_applied"] == [steps, steps], report
            assert report["global_step"] == steps, report
        else:  # every push applied on arrival, the other worker at most staleness behind
            assert all(steps <= n <= 2 * steps for n in report["table_applied"]), report
        assert report["final_loss"] < 0.9 * report["first_loss"], report


def test_a_done_from_a_worker_outside_the_replicas_is_refused(ps_tasks):
    _, clients = ps_tasks
    w0 = clients(1, SYNC)[0]
    w0.init_table(table())
    w0.worker_id = 7
    with pytest.raises(InvalidArgumentError, match=r"Done to table 't' from worker 7 was refused"):
        w0.done()
