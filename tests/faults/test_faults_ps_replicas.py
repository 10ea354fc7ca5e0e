"""A primary ps task killed (kill -9) or suspended (SIGSTOP) mid-run with ``replicas=1``, real
processes on loopback: its replica, promoted, holds every acknowledged push once, a push in
flight sent again is applied once, and the old primary, resumed, refuses pushes."""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import replica_calls as calls

from towerflow.errors import FailedPreconditionError, TowerflowError
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing import LocalCluster, loopback_cluster, wait_until

PLAN = plan_placement({"a": (256,), "b": (256,)}, 2)


@contextlib.contextmanager
def replicated_ps(env: dict[str, str]) -> Iterator[tuple[Any, Any]]:
    """Two ps task processes initialised with ``replicas=1`` (sgd, zeros) -> (ps, chief)."""
    spec = loopback_cluster(2, 1)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"], env=env) as lc:
        ps = [lc.start("ps", i) for i in range(2)]
        for i, task in enumerate(ps):
            task.wait_for_line(rf"ps task {i} serving at", timeout=60)
        with PSClient(spec, PLAN, worker_id=0, credentials=lc.credentials,
                      timeout=10.0) as chief:
            chief.initialize([np.zeros(s.numel, np.float32) for s in PLAN.shards],
                             optimizer=pb.OptimizerSpec(name="sgd"),
                             aggregation=AggregationConfig(total_num_replicas=1, replicas=1))
            yield ps, chief


@pytest.mark.slow
def test_kill_9_of_a_primary_loses_no_acknowledged_push_and_doubles_none(subprocess_env):
    layout = PLAN.shards[0]
    with replicated_ps(subprocess_env) as (ps, chief):
        primary, replica = chief.shards[0].channel, chief.shards[1].channel
        acked: list[int] = []
        failure: list[BaseException] = []

        def pushes() -> None:  # seq 1, 2, ... to shard 0 until its primary is gone
            seq = 0
            try:
                while True:
                    seq += 1
                    reply = calls.push(primary, layout, seq=seq, lr=1.0)
                    assert reply.status == "applied" and not reply.duplicate
                    acked.append(seq)
            except TowerflowError as exc:
                failure.append(exc)

        pusher = threading.Thread(target=pushes, daemon=True)
        pusher.start()
        try:
            wait_until(lambda: len(acked) >= 30, timeout=60, what="30 acknowledged pushes")
            ps[0].kill()  # SIGKILL, mid-push
        finally:
            pusher.join(timeout=60)
        assert not pusher.is_alive() and failure, "the pusher ended with an error"
        last = acked[-1]
        promoted = calls.promote(replica, 0)
        assert promoted.term == 2 and promoted.step >= last  # no acknowledged push lost
        values = calls.pull(replica, shard=0, term=2)
        # sgd, lr 1, gradient 1: each push applied once takes 1 off every element
        np.testing.assert_array_equal(values, np.full(layout.numel, -promoted.step,
                                                      np.float32))
        assert promoted.step <= last + 1  # at most the one push in flight besides
        resent = calls.push(replica, layout, seq=last + 1, lr=1.0, shard=0, term=2)
        assert resent.status == "applied" and resent.duplicate == (promoted.step > last)
        np.testing.assert_array_equal(calls.pull(replica, shard=0, term=2),
                                      np.full(layout.numel, -(last + 1), np.float32))


@pytest.mark.slow
def test_a_suspended_primary_resumed_after_its_replica_took_over_refuses_pushes(
        subprocess_env):
    layout = PLAN.shards[0]
    with replicated_ps(subprocess_env) as (ps, chief):
        primary, replica = chief.shards[0].channel, chief.shards[1].channel
        assert calls.push(primary, layout, seq=1, lr=1.0).status == "applied"
        ps[0].suspend()  # SIGSTOP: it stops answering; its replica takes the shard over
        try:
            assert calls.promote(replica, 0).term == 2
        finally:
            ps[0].resume()  # SIGCONT: it comes back believing it is the primary
        with pytest.raises(FailedPreconditionError, match=re.escape(
                "ps task 0 is no longer the primary of shard 0 (term 1, now term 2 on ps "
                "task 1)")):
            calls.push(primary, layout, seq=2, lr=1.0)
        with pytest.raises(FailedPreconditionError, match="no longer the primary of shard 0"):
            calls.push(primary, layout, seq=3, lr=1.0)
        assert calls.status(primary).role == "deposed"
        np.testing.assert_array_equal(calls.pull(replica, shard=0, term=2),
                                      np.full(layout.numel, -1.0, np.float32))
