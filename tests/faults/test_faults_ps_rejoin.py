"""A ps task killed mid-run and started again rejoins as the copy of the shards its death
left without one (``replicas=1``, async, real ps processes on loopback): the shards' rows
are copied to it in parts while two workers go on pushing, after which the other ps task
can be killed too and training goes on, on the replacement, with every acknowledged push
present exactly once; a replacement killed during its catch-up is caught up again once
started again."""

from __future__ import annotations

import re

import pytest
import torch
from replica_job import PLAN, Pushers, check_exactly_once, replicated_job

from towerflow.ps import PSClient
from towerflow.ps.partition import HashPartitioner, ModPartitioner
from towerflow.ps.server.tables.replica import COPY_CHUNK_ROWS
from towerflow.ps.spec.tables import TableConfig
from towerflow.testing import wait_until

#: a table of several copy parts per shard (the pushes change its first 20 rows)
BIG = TableConfig("t", ModPartitioner(2, num_rows=6 * COPY_CHUNK_ROWS), 3,
                  {"name": "sgd", "hyper": {}}, {"kind": "constant", "value": 0.0})
#: a dynamic table (any int64 id, rows made on first push) of the same shape
DYNAMIC = TableConfig("t", HashPartitioner(2), 3, {"name": "sgd", "hyper": {}},
                      {"kind": "constant", "value": 0.0},
                      store={"kind": "dynamic", "admit_after": 1, "evict_after_steps": None,
                             "capacity": None})
_AGAIN = r"shard {} has a live copy on ps task 0 again"


def _more(run: Pushers, count: int = 10) -> None:
    """Wait for ``count`` more acknowledged pushes."""
    reached = len(run.acked) + count
    wait_until(lambda: len(run.acked) >= reached or run.failures, timeout=60,
               what=f"{count} more acknowledged pushes")
    assert not run.failures, run.failures


def _on(clients: list, shard: int, task: int) -> bool:
    """Whether every worker's dense and table calls of ``shard`` go to ps task ``task``."""
    routes = [w.shards[shard].route for w in clients[0]] + \
        [t._routing.routes[shard] for t in clients[1]]
    return all(route.task == task for route in routes)


def _last_task_dies(ps: list, clients: tuple, run: Pushers) -> None:
    """Once the replacement of ps task 0 caught up: kill ps task 1; both shards go on there."""
    _more(run)
    ps[1].kill()
    wait_until(lambda: _on(clients, 0, 0) and _on(clients, 1, 0), timeout=30,
               what="both shards on the replacement")
    _more(run)
    run.stop()


def _check_every_push_once(workers: list, tables: list, run: Pushers,
                           table: TableConfig = BIG) -> None:
    """Every acknowledged push once in the dense shards and the pushed rows; the rows no
    push changed (every copy part's) are the initial ones, on the shards' last primary."""
    assert not run.failures, run.failures
    check_exactly_once(workers, tables, "both", pushed=len(run.acked), table=table)
    ids = torch.arange(20, 6 * COPY_CHUNK_ROWS, 977)
    assert torch.equal(tables[0].pull(table, ids), torch.zeros(len(ids), 3))


@pytest.mark.slow
@pytest.mark.parametrize("table", [BIG, DYNAMIC], ids=["fixed", "dynamic"])
def test_a_replacement_rejoins_as_the_copy_and_takes_over_when_the_other_task_dies(
        subprocess_env, table):
    with replicated_job(subprocess_env, table) as (ps, workers, tables, (spec, credentials)):
        clients = (workers, tables)
        with Pushers(workers, tables, "both", pushes=None, table=table) as run:
            _more(run)
            ps[0].kill()  # shard 0 fails over to ps task 1; shard 1 goes on there alone
            wait_until(lambda: _on(clients, 0, 1), timeout=30, what="shard 0 on ps task 1")
            _more(run)
            ps[0].start()  # its replacement: rejoins as the copy of both shards
            for shard in (0, 1):
                ps[1].wait_for_line(_AGAIN.format(shard), timeout=60)
            _last_task_dies(ps, clients, run)
        _check_every_push_once(workers, tables, run, table)
        assert workers[0].shards[0].route.where() == (0, 3)  # ps 0, ps 1, ps 0 again
        assert workers[0].shards[1].route.where() == (0, 2)
        status = workers[0].shards[0].status()
        assert (status.term, status.role, status.step) == (3, "primary", len(run.acked))
        assert status.alone  # its copy's task (ps task 1) is gone
        with PSClient(spec, PLAN, worker_id=1, credentials=credentials, timeout=10.0,
                      replicas=1) as late:  # a worker started now finds both shards
            assert late.wait_until_initialized(timeout=30, poll=0.05) == status.step
            assert [s.route.where() for s in late.shards] == [(0, 3), (0, 2)]


@pytest.mark.slow
def test_a_replacement_killed_during_its_catch_up_is_caught_up_once_started_again(
        subprocess_env):
    with replicated_job(subprocess_env, BIG) as (ps, workers, tables, _):
        clients = (workers, tables)
        with Pushers(workers, tables, "both", pushes=None, table=BIG) as run:
            _more(run)
            ps[0].kill()
            wait_until(lambda: _on(clients, 0, 1), timeout=30, what="shard 0 on ps task 1")
            ps[0].start()
            ps[1].wait_for_line(r"ps task 0 answers; copying shard", timeout=60)
            ps[0].kill()  # during its catch-up: ps task 1 goes on alone
            _more(run)
            before = [len(ps[1].find(_AGAIN.format(shard))) for shard in (0, 1)]
            ps[0].start()
            for shard in (0, 1):  # caught up after this start
                ps[1].wait_for_line(_AGAIN.format(shard), timeout=60, count=before[shard] + 1)
            _last_task_dies(ps, clients, run)
        _check_every_push_once(workers, tables, run)


@pytest.mark.slow
def test_a_primary_lost_during_its_copys_catch_up_is_not_replaced_by_half_a_copy(
        subprocess_env):
    with replicated_job(subprocess_env, BIG, push_wait=1.0) as (ps, workers, tables, _):
        with Pushers(workers, tables, "dense", pushes=None, table=BIG) as run:
            _more(run)
            ps[0].kill()
            wait_until(lambda: _on((workers, []), 0, 1), timeout=30, what="shard 0 on ps task 1")
            ps[0].start()
            ps[1].wait_for_line(r"ps task 0 answers; copying shard", timeout=60)
            ps[0].suspend()  # its catch-up stalls half way (or before it began)
            ps[1].kill()  # the primary of both shards is lost during the catch-up
            ps[0].resume()
            wait_until(lambda: len(run.failures) == 2, timeout=60,
                       what="both workers stopped with the sentence")
    said = " ".join(str(exc) for exc in run.failures)
    assert "could not take it over" in said, said
    assert re.search(r"had not finished copying to it|holds nothing of shard|holds no copy of "
                     r"shard", said), said
