"""A dense shard's live replica on the next ps task, over real authenticated gRPC on 127.0.0.1.

Two ps tasks: shard 0's copy lives on ps task 1 and shard 1's on ps task 0.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import replica_calls as calls

from towerflow.cluster import ClusterSpec, Server
from towerflow.cluster.transport import Credentials
from towerflow.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import APPLIED
from towerflow.testing import wait_until

SECRET = Credentials(secret=b"test-secret")
SHAPES = {"emb": (40, 5), "w": (5, 3), "b": (3,)}


@pytest.fixture
def replicated(free_ports):
    """``start(**init)``: two ps tasks in this process, initialised with ``replicas=1``
    (``init``: AggregationConfig options) -> (cluster, services, servers, placement).
    Every server started is stopped at the end of the test."""
    servers: list[Server] = []

    def start(optimizer: str = "adam", replica_timeout: float = 5.0, **init):
        ports = free_ports(3)
        cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                               "worker": [f"127.0.0.1:{ports[2]}"]})
        services = []
        for i in range(2):
            server, service = calls.serve_ps(cluster, i, SECRET, replica_timeout=replica_timeout)
            servers.append(server)
            services.append(service)
        plan = plan_placement(SHAPES, 2, partition_threshold_bytes=400)
        init.setdefault("replicas", 1)
        with PSClient(cluster, plan, worker_id=0, timeout=5.0, credentials=SECRET,
                      chunk_bytes=64) as chief:
            chief.initialize([np.arange(s.numel, dtype=np.float32) for s in plan.shards],
                             optimizer=pb.OptimizerSpec(name=optimizer),
                             aggregation=AggregationConfig(**init))
        return cluster, services, servers, plan

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def channel(servers, task):
    return servers[0].channel("ps", task) if task else servers[1].channel("ps", 0)


def push(servers, plan, *, task, shard=-1, **kw):
    """A push to ``shard`` (-1: the task's own) sent to ps task ``task``."""
    return calls.push(channel(servers, task), plan.shards[task if shard < 0 else shard],
                      shard=shard, **kw)


def pull(servers, *, task, **kw):
    return calls.pull(channel(servers, task), **kw)


def promote(servers, *, task, shard):
    return calls.promote(channel(servers, task), shard)


def assert_same_shard(primary, copy):
    a, b = primary.shard.state, copy.shard.state
    np.testing.assert_array_equal(a.params, b.params)
    assert list(a.optimizer.slots) == list(b.optimizer.slots) and a.optimizer.slots
    for name in a.optimizer.slots:
        np.testing.assert_array_equal(a.optimizer.slots[name], b.optimizer.slots[name])
    assert (a.step, a.optimizer.step) == (b.step, b.optimizer.step)
    assert a.admission.push_rows() == b.admission.push_rows()


def test_each_acknowledged_push_is_on_the_replica_bit_for_bit(replicated) -> None:
    cluster, services, servers, plan = replicated()
    copies = [services[1].copies.get(0), services[0].copies.get(1)]
    for shard in (0, 1):
        assert copies[shard].term.role == "replica"
        assert_same_shard(services[shard], copies[shard])  # the Init's copy
    with PSClient(cluster, plan, worker_id=0, timeout=5.0, credentials=SECRET,
                  chunk_bytes=64) as worker:
        for _ in range(3):
            result = worker.push([np.linspace(-1, 1, s.numel, dtype=np.float32)
                                  for s in plan.shards], lr=0.05)
            assert result.applied
            for shard in (0, 1):  # acknowledged: the replica holds it already
                assert_same_shard(services[shard], copies[shard])
    assert services[0].shard.state.step == 3
    assert services[0].shard.state.admission.push_rows()[0][2] == 3  # seq 3 answered
    status = calls.status(channel(servers, 1))
    assert (status.term, status.role) == (1, "primary")
    assert [(r.shard, r.role, r.step) for r in status.replicas] == [(0, "replica", 3)]


def test_a_push_is_not_acknowledged_while_the_replica_is_unreachable(replicated) -> None:
    _, services, servers, plan = replicated(replica_timeout=1.0)
    servers[1].stop()  # ps task 1 holds shard 0's replica
    with pytest.raises(UnavailableError, match=re.escape(
            "its replica on ps task 1 did not acknowledge the copy within 1 s")) as info:
        push(servers, plan, task=0, seq=1)
    assert "the push is not acknowledged" in str(info.value)
    assert "start ps task 1 again, or train with replicas=0" in str(info.value)


def test_a_promoted_replica_serves_the_shard_and_applies_a_resent_push_once(
        replicated) -> None:
    _, services, servers, plan = replicated()
    assert push(servers, plan, task=0, seq=1).status == APPLIED
    before = services[0].shard.state.params.copy()
    reply = promote(servers, task=1, shard=0)
    assert (reply.term, reply.step) == (2, 1)
    np.testing.assert_array_equal(pull(servers, task=1, shard=0, term=2), before)
    again = push(servers, plan, task=1, shard=0, term=2, seq=1)  # the in-flight push, resent
    assert again.status == APPLIED and again.duplicate
    np.testing.assert_array_equal(pull(servers, task=1, shard=0, term=2), before)
    fresh = push(servers, plan, task=1, shard=0, term=2, seq=2)
    assert fresh.status == APPLIED and not fresh.duplicate and fresh.step == 2
    assert not np.array_equal(pull(servers, task=1, shard=0, term=2), before)
    assert services[1].copies.get(0).shard.state.admission.push_rows() == [
        (0, 7, 2, APPLIED)]
    assert promote(servers, task=1, shard=0).term == 2  # promoting again changes nothing


def test_the_stale_primary_refuses_pushes_and_pulls_after_the_promotion(replicated) -> None:
    _, services, servers, plan = replicated()
    assert push(servers, plan, task=0, seq=1).status == APPLIED
    promote(servers, task=1, shard=0)
    kept = services[1].copies.get(0).shard.state.params.copy()
    # the old primary applies it, but its replica refuses the copy: never acknowledged
    with pytest.raises(FailedPreconditionError, match=re.escape(
            "ps task 0 is no longer the primary of shard 0 (term 1, now term 2 on ps task 1)")):
        push(servers, plan, task=0, seq=2)
    assert services[0].term.role == "deposed"
    np.testing.assert_array_equal(services[1].copies.get(0).shard.state.params, kept)
    step = services[0].shard.state.step
    with pytest.raises(FailedPreconditionError, match="no longer the primary of shard 0"):
        push(servers, plan, task=0, seq=3)
    assert services[0].shard.state.step == step  # refused before anything was applied
    with pytest.raises(FailedPreconditionError, match="no longer the primary of shard 0"):
        pull(servers, task=0)
    # ps task 0 still serves its own copy of shard 1 and shard 1 as primary
    assert push(servers, plan, task=1, seq=1).status == APPLIED


def test_a_request_naming_a_newer_term_deposes_the_primary(replicated) -> None:
    _, services, servers, plan = replicated()
    with pytest.raises(FailedPreconditionError, match=re.escape(
            "ps task 0 is no longer the primary of shard 0 (term 1, now term 2 on ps task 1)")):
        push(servers, plan, task=0, seq=1, term=2)
    assert services[0].term.role == "deposed" and services[0].shard.state.step == 0


def test_requests_that_name_a_stale_term_or_an_unpromoted_replica_are_refused(
        replicated) -> None:
    _, services, servers, plan = replicated()
    with pytest.raises(FailedPreconditionError, match=re.escape(
            "ps task 1 holds only a replica of shard 0 (term 1)")):
        push(servers, plan, task=1, shard=0, seq=1)
    promote(servers, task=1, shard=0)
    with pytest.raises(FailedPreconditionError, match=re.escape(
            "named its term 1; the shard is at term 2 on ps task 1")):
        push(servers, plan, task=1, shard=0, term=1, seq=1)
    assert services[1].copies.get(0).shard.state.step == 0


def test_an_init_asking_replicas_it_cannot_have_is_refused(replicated) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "aggregation.replicas = 2 is invalid: it must be between 0 and 1")):
        replicated(replicas=2)


def test_without_replicas_nothing_is_copied(replicated) -> None:
    _, services, servers, plan = replicated(replicas=0)
    assert push(servers, plan, task=0, seq=1).status == APPLIED
    assert services[1].copies.get(0) is None and services[0].copies.get(1) is None


def test_a_restarted_replica_task_is_caught_up_and_a_copy_not_caught_up_is_not_promoted(
        replicated) -> None:
    from towerflow.ps.server.rejoin import Rejoin

    cluster, services, servers, plan = replicated()
    assert push(servers, plan, task=0, seq=1).status == APPLIED
    servers[1].stop()  # ps task 1, shard 0's replica, ends; a new one starts in its place
    server, fresh = calls.serve_ps(cluster, 1, SECRET)
    servers.append(server)  # stopped at the end of the test with the others
    assert fresh.copies.get(0) is None
    reply = calls.push(servers[0].channel("ps", 0), plan.shards[0], seq=2)
    # it says it holds no copy: the primary goes on alone (applied once: the channel may
    # have sent the call again while the new task's identity was learnt)
    assert reply.status == APPLIED and reply.step == services[0].shard.state.step == 2
    assert services[0].term.alone and fresh.copies.get(0) is None
    services[0].replica_link().seed(catch_up=True)  # a catch-up's first part, no more yet
    with pytest.raises(FailedPreconditionError, match="had not finished copying to it"):
        calls.promote(server.channel("ps", 1), 0)  # half a copy never takes a shard over
    rejoin, joined = Rejoin(services[0]), []
    wait_until(lambda: joined.extend(rejoin.round()) or joined == [0], timeout=20,
               what="shard 0's copy caught up on the new task")
    assert not services[0].term.alone
    assert_same_shard(services[0], fresh.copies.get(0))  # the whole shard
    assert fresh.copies.get(0).shard.state.admission.push_rows() == [(0, 7, 2, APPLIED)]
    assert push(servers, plan, task=0, seq=3).status == APPLIED
    assert_same_shard(services[0], fresh.copies.get(0))  # acknowledged: copied again


def test_a_replacement_task_rejoins_as_the_copy_and_a_restarted_chief_inits_the_copy(
        replicated) -> None:
    from towerflow.ps.server.rejoin import Rejoin

    cluster, services, servers, plan = replicated()
    assert push(servers, plan, task=0, seq=1).status == APPLIED
    servers[0].stop()  # ps task 0 dies; its shard's copy on ps task 1 takes it over
    assert promote(servers, task=1, shard=0).term == 2
    taken = services[1].copies.get(0)
    assert taken.term.alone  # promoted: no copy of its own yet
    assert services[1].terms.of(1).go_alone() == 1  # as a worker asks once a push failed
    assert Rejoin(services[1]).round() == []  # ps task 0 does not answer: nothing to do
    with PSClient(cluster, plan, worker_id=0, timeout=5.0, credentials=SECRET, chunk_bytes=64,
                  replicas=1) as chief:  # a chief started again: its Init reaches the copy
        chief.initialize([np.full(s.numel, 2.0, np.float32) for s in plan.shards],
                         optimizer=pb.OptimizerSpec(name="adam"),
                         aggregation=AggregationConfig(replicas=1))
        assert chief.shards[0].route.where() == (1, 2)
    np.testing.assert_array_equal(taken.shard.state.params, 2.0)
    replacement, fresh = calls.serve_ps(cluster, 0, SECRET)
    servers.append(replacement)
    rejoin, joined = Rejoin(services[1]), []  # once it answers: both shards copied to it
    wait_until(lambda: joined.extend(rejoin.round()) or sorted(joined) == [0, 1], timeout=20,
               what="both shards' copies on the replacement")
    assert not taken.term.alone
    assert (fresh.term.role, fresh.term.term) == ("replica", 2)
    assert_same_shard(taken, fresh)
    with pytest.raises(FailedPreconditionError, match="holds only a replica of shard 0"):
        calls.push(replacement.channel("ps", 0), plan.shards[0], seq=2)  # not its primary
    assert push(servers, plan, task=1, shard=0, term=2, seq=2).status == APPLIED
    assert_same_shard(taken, fresh)  # acknowledged: on the rejoined copy already
    servers[1].stop()  # now ps task 1 dies: shard 0 goes back to its own task
    assert calls.promote(replacement.channel("ps", 0), 0).term == 3
    assert calls.push(replacement.channel("ps", 0), plan.shards[0], shard=0, term=3,
                      seq=2).duplicate  # the ledger came along
