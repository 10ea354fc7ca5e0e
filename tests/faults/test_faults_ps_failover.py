"""Workers switch a shard to its replica when its primary is killed (kill -9) or suspended
(SIGSTOP) mid-run, ``replicas=1``, async, real ps processes on loopback: two workers go on
pushing (dense shards, table rows, or both) without a restart, every acknowledged push is in
the parameters and rows exactly once, the status shows the switch, and a suspended primary
resumed acknowledges nothing more."""

from __future__ import annotations

import time

import numpy as np
import pytest
import replica_calls as calls
from replica_job import (
    PLAN,
    PUSHES,
    TABLE,
    WORKERS,
    Pushers,
    check_exactly_once,
    replicated_job,
)

from towerflow.errors import FailedPreconditionError, UnavailableError
from towerflow.ps import PSClient
from towerflow.testing import wait_until


@pytest.mark.slow
@pytest.mark.parametrize("what", ["dense", "tables", "both"])
def test_kill_9_of_a_primary_mid_run_the_workers_switch_to_its_replica(subprocess_env, what):
    with replicated_job(subprocess_env) as (ps, workers, tables, (spec, credentials)):
        with Pushers(workers, tables, what) as run:
            wait_until(lambda: len(run.acked) >= 10, timeout=60, what="10 acknowledged pushes")
            killed = time.monotonic()
            ps[0].kill()  # SIGKILL, with pushes in flight
        assert not run.failures, run.failures
        assert len(run.acked) == WORKERS * PUSHES
        after = [t for t in run.acked if t > killed]
        assert after and after[0] - killed < 5.0  # the next completed push, within 5 s
        check_exactly_once(workers, tables, what)
        routes = [w.shards[0].route for w in workers if what != "tables"] + \
            [t._routing.routes[0] for t in tables if what != "dense"]
        assert {(route.task, route.term) for route in routes} == {(1, 2)}
        status = workers[0].shards[0].status()  # routed: the shard's copy on ps task 1
        assert (status.shard, status.term, status.role) == (0, 2, "primary")
        assert status.step == (WORKERS * PUSHES if what != "tables" else 0)
        snapshot = workers[0].snapshot()[0]  # a checkpoint's read: from the new primary
        assert snapshot.step == status.step
        np.testing.assert_array_equal(snapshot.params, np.full(
            PLAN.shards[0].numel, -float(snapshot.step), np.float32))
        if what != "dense":  # the table client switched too: its export reads the copy
            assert sum(c.num_ids for c in tables[0].export_shard(TABLE, 0)) == 10
        with pytest.raises(FailedPreconditionError, match="ledger of shard 0 went with ps"):
            workers[0].ledger()  # not ps task 1's own shard's ledger in its place
        copies = {r.shard: r for r in calls.status(workers[0].channels[1]).replicas}
        assert (copies[0].term, copies[0].role) == (2, "primary")
        with PSClient(spec, PLAN, worker_id=1, credentials=credentials, timeout=10.0,
                      replicas=1) as late:  # a worker started after the switch
            assert late.wait_until_initialized(timeout=30, poll=0.05) == status.step
            assert late.shards[0].route.where() == (1, 2)  # found the shard on its copy


@pytest.mark.slow
def test_a_suspended_primary_is_switched_from_and_refuses_pushes_once_resumed(
        subprocess_env):
    with replicated_job(subprocess_env) as (ps, workers, tables, _):
        with Pushers(workers, tables) as run:
            wait_until(lambda: len(run.acked) >= 10, timeout=60, what="10 acknowledged pushes")
            ps[0].suspend()  # SIGSTOP: its calls run out of time; its replica takes over
            try:
                wait_until(lambda: all(w.shards[0].route.task == 1 for w in workers),
                           timeout=30, what="both workers on shard 0's replica")
            finally:
                ps[0].resume()  # SIGCONT: it comes back believing it is the primary
        assert not run.failures, run.failures
        check_exactly_once(workers, tables)
        # the old primary acknowledges nothing more: a push with the old term is refused
        with pytest.raises(FailedPreconditionError,  # deposed, or rejoined as the copy already
                           match="no longer the primary of shard 0|holds only a replica of shard 0"):
            calls.push(workers[0].channels[0], PLAN.shards[0], seq=1, lr=1.0, worker=1,
                       incarnation=99, term=1)
        assert calls.status(workers[0].channels[0]).role in ("deposed", "replica")


@pytest.mark.slow
def test_a_primary_and_its_replica_both_gone_give_a_sentence(subprocess_env):
    with replicated_job(subprocess_env) as (ps, workers, _tables, _):
        ps[1].kill()  # the replica's task first: shard 0 has nowhere to go
        ps[0].kill()
        shard = workers[0].shards[0]
        shard.timeout = 3.0
        with pytest.raises(UnavailableError, match="its replica on ps task 1 could not take "
                                                   "it over"):
            shard.pull(np.empty(PLAN.shards[0].numel, np.float32))
        assert shard.route.task == 0
