"""A sync or ssp dense shard's live replica on the next ps task, over real authenticated gRPC on
127.0.0.1: the aggregated step (not each worker's push) is copied before any worker of the step
is answered, with the ssp clocks and the workers done; a step cut off by the switch completes
on the copy bit for bit.

Two ps tasks in this process: shard 0's copy lives on ps task 1 and shard 1's on ps task 0.
"""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import replica_calls as calls

from towerflow.cluster import ClusterSpec, Server
from towerflow.cluster.transport import Credentials
from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.server.dense.initspec import check_init
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import APPLIED
from towerflow.testing import wait_until

SECRET = Credentials(secret=b"test-secret")
SHAPES = {"w": (6, 4), "b": (4,)}
PLAN = plan_placement(SHAPES, 2, partition_threshold_bytes=40)


@pytest.fixture
def replicated(free_ports):
    """``start(**aggregation)``: two ps tasks in this process initialised with ``replicas=1``
    and adam -> services. Every server started is stopped at the end of the test."""
    servers: list[Server] = []
    pool = ThreadPoolExecutor(4)

    def start(**aggregation):
        ports = free_ports(3)
        cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                               "worker": [f"127.0.0.1:{ports[2]}"]})
        services = []
        for i in range(2):
            server, service = calls.serve_ps(cluster, i, SECRET)
            servers.append(server)
            services.append(service)
        with PSClient(cluster, PLAN, worker_id=0, timeout=5.0, credentials=SECRET,
                      chunk_bytes=64) as chief:
            chief.initialize([np.linspace(-1, 1, s.numel, dtype=np.float32)
                              for s in PLAN.shards], optimizer=pb.OptimizerSpec(name="adam"),
                             aggregation=AggregationConfig(replicas=1, total_num_replicas=2,
                                                           **aggregation))
        return services, servers, pool

    try:
        yield start
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for server in servers:
            server.stop()


def channel(servers, task):
    return servers[0].channel("ps", task) if task else servers[1].channel("ps", 0)


def gradient(worker: int, step: int) -> np.ndarray:
    """Worker ``worker``'s gradient of step ``step`` (shard 0), not exactly representable sums."""
    return np.sin(np.arange(PLAN.shards[0].numel, dtype=np.float32) * (worker + 1.7) + step
                  ).astype(np.float32)


def push(servers, *, task: int, worker: int, step: int, seq: int, term: int = 0,
         shard: int = -1) -> pb.PushReply:
    """Worker ``worker``'s push of ``gradient(worker, step)`` to shard 0, sent to ``task``."""
    return calls.push(channel(servers, task), PLAN.shards[0], seq=seq, worker=worker,
                      token=step, value=gradient(worker, step), term=term, shard=shard,
                      incarnation=7 + worker)


def later(pool, fn, *args, **kw) -> Future:
    return pool.submit(fn, *args, **kw)


def counted(service, n: int) -> bool:
    return service.shard.aggregator.counted == n


def assert_same_shard(a, b) -> None:
    a, b = a.shard.state, b.shard.state
    np.testing.assert_array_equal(a.params, b.params)
    for name in a.optimizer.slots:
        np.testing.assert_array_equal(a.optimizer.slots[name], b.optimizer.slots[name])
    assert (a.step, a.optimizer.step) == (b.step, b.optimizer.step)
    assert a.admission.push_rows() == b.admission.push_rows()


def test_a_sync_step_is_on_the_replica_before_either_worker_is_answered(replicated) -> None:
    services, servers, pool = replicated(mode="sync")
    copy = services[1].copies.get(0)
    first = later(pool, push, servers, task=0, worker=0, step=0, seq=1)
    wait_until(lambda: counted(services[0], 1), timeout=10, what="worker 0's gradient summed")
    assert copy.shard.state.step == 0  # each push is not copied: the step is, once applied
    reply = push(servers, task=0, worker=1, step=0, seq=1)
    assert (reply.status, reply.step) == (APPLIED, 1)
    assert copy.shard.state.step == 1  # answered: the replica holds the step already
    assert_same_shard(services[0], copy)
    assert (first.result(timeout=10).status, first.result().step) == (APPLIED, 1)
    assert [row[:3] for row in copy.shard.state.admission.push_rows()] == [(0, 7, 1), (1, 8, 1)]


def test_a_step_cut_off_by_the_switch_completes_on_the_copy_bit_for_bit(replicated) -> None:
    services, servers, pool = replicated(mode="sync")
    copy = services[1].copies.get(0)
    steps = [later(pool, push, servers, task=0, worker=0, step=0, seq=1),
             later(pool, push, servers, task=0, worker=1, step=0, seq=1)]
    assert [f.result(timeout=10).step for f in steps] == [1, 1]
    cut = later(pool, push, servers, task=0, worker=0, step=1, seq=2)  # never answered
    wait_until(lambda: counted(services[0], 1), timeout=10, what="worker 0's gradient summed")
    assert calls.promote(channel(servers, 1), 0).term == 2  # the switch, mid-step
    # on the copy the two workers' pushes of step 1 arrive the other way round
    resent = later(pool, push, servers, task=1, worker=1, step=1, seq=2, term=2, shard=0)
    wait_until(lambda: counted(copy, 1), timeout=10, what="worker 1's gradient summed")
    again = push(servers, task=1, worker=0, step=1, seq=2, term=2, shard=0)  # worker 0's, resent
    assert (again.status, again.step, resent.result(timeout=10).step) == (APPLIED, 2, 2)
    # the deposed primary completes its step with the same gradients: the same shard after it
    with pytest.raises(FailedPreconditionError, match="no longer the primary of shard 0"):
        push(servers, task=0, worker=1, step=1, seq=2)
    with pytest.raises(FailedPreconditionError, match="no longer the primary of shard 0"):
        cut.result(timeout=10)
    assert services[0].shard.state.step == 2
    assert_same_shard(services[0], copy)


def test_the_ssp_clocks_and_the_workers_done_survive_the_switch(replicated) -> None:
    services, servers, pool = replicated(mode="ssp", staleness=1)
    for worker, seq in ((0, 1), (1, 1), (0, 2)):
        assert push(servers, task=0, worker=worker, step=0, seq=seq).status == APPLIED
    copy = services[1].copies.get(0)
    assert copy.shard.aggregator.round_state() == ([2, 1], [])  # as the primary's
    assert calls.promote(channel(servers, 1), 0).term == 2
    # worker 0 is 1 push ahead, its bound: its next push is applied, then waits for worker 1
    ahead = later(pool, push, servers, task=1, worker=0, step=0, seq=3, term=2, shard=0)
    wait_until(lambda: copy.shard.state.step == 4, timeout=10, what="worker 0's push applied")
    assert not ahead.done()  # the clocks came over: the bound holds on the copy
    assert push(servers, task=1, worker=1, step=0, seq=2, term=2, shard=0).status == APPLIED
    assert ahead.result(timeout=10).status == APPLIED
    for task in (0, 1):  # worker 1 is done: told to each ps task, the copies hear it too
        calls.done(channel(servers, task), 1)
    assert copy.shard.aggregator.round_state() == ([3, 2], [1])
    assert 1 in services[0].copies.get(1).shard.aggregator.round_state()[1]


def test_the_copy_of_a_shard_with_a_worker_done_is_sent_with_it(replicated) -> None:
    services, servers, _ = replicated(mode="sync")
    calls.done(channel(servers, 0), 1)  # to ps task 0 only: its own shard, not the copy
    assert 1 not in services[1].copies.get(0).shard.aggregator.round_state()[1]
    reply = push(servers, task=0, worker=0, step=0, seq=1)  # worker 1 is done: alone
    assert (reply.status, reply.step) == (APPLIED, 1)
    assert services[1].copies.get(0).shard.aggregator.round_state() == ([], [1])


def test_a_copy_with_a_bad_round_state_is_refused_with_a_sentence(replicated) -> None:
    services, _, _ = replicated(mode="ssp")
    copy = services[1].copies.get(0)
    state = services[0].shard.state
    numel, slots = state.layout.numel, list(state.optimizer.slots)
    header = pb.ReplicateRequest(shard=0, term=1, version=99, step=5, numel=numel, slots=slots,
                                 round=pb.RoundState(clocks=[1, 2, 3]))
    payload = np.full(numel * (1 + len(slots)), 9.0, np.float32).tobytes()
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "A copy of shard 0 from its primary: round.clocks = [1, 2, 3] is invalid: ssp mode "
            "keeps one clock >= 0 per replica (2), or none.")):
        services[1].copies.replicate(iter([header.SerializeToString(), payload]))
    assert copy.shard.state.step == 0 and not np.any(copy.shard.state.params == 9.0)
    header.round.CopyFrom(pb.RoundState(done=[2]))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "round.done = [2] is invalid: it names distinct replicas 0 .. 1.")):
        services[1].copies.replicate(iter([header.SerializeToString(), payload]))


@pytest.mark.parametrize(("mode", "round_state", "message"), [
    ("async", pb.RoundState(clocks=[0]), "round.clocks = [0] is invalid: async mode keeps "
                                         "none."),
    ("sync", pb.RoundState(done=[0, 0]), "round.done = [0, 0] is invalid: it names distinct "
                                         "replicas 0 .. 0."),
    ("ssp", pb.RoundState(clocks=[-1]), "round.clocks = [-1] is invalid"),
])
def test_an_init_with_a_bad_round_state_is_refused_with_a_sentence(mode, round_state,
                                                                    message) -> None:
    req = pb.InitRequest(optimizer=pb.OptimizerSpec(name="sgd"), round=round_state,
                         aggregation=pb.AggregationSpec(mode=mode, total_num_replicas=1))
    with pytest.raises(InvalidArgumentError, match=re.escape("Init of ps shard 0: " + message)):
        check_init(req, 0)


def test_an_init_may_ask_a_replica_in_every_mode() -> None:
    for mode in ("async", "sync", "ssp"):
        req = pb.InitRequest(optimizer=pb.OptimizerSpec(name="sgd"), aggregation=pb.AggregationSpec(
            mode=mode, total_num_replicas=2, replicas=1), round=pb.RoundState(done=[1]))
        plan = check_init(req, 0)
        assert (plan.config.replicas, plan.round[1]) == (1, (1,))


def test_ssp_workers_at_the_bound_push_on_while_each_push_is_copied(replicated) -> None:
    services, servers, pool = replicated(mode="ssp", staleness=0)
    pushes = 30

    def run(worker: int) -> list[str]:
        return [push(servers, task=0, worker=worker, step=0, seq=seq).status
                for seq in range(1, pushes + 1)]

    runs = [later(pool, run, worker) for worker in (0, 1)]
    assert [r.result(timeout=30) for r in runs] == [[APPLIED] * pushes] * 2
    assert_same_shard(services[0], services[1].copies.get(0))
    assert services[1].copies.get(0).shard.aggregator.round_state() == ([pushes] * 2, [])
