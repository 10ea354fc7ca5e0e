"""The ps shard service and the worker client over real, authenticated gRPC on 127.0.0.1."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import numpy as np
import pytest

from towerflow.cluster import ClusterSpec, Server
from towerflow.cluster.transport import Credentials
from towerflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from towerflow.ps import AggregationConfig, PSClient, PSService, plan_placement
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.framing import CHUNK_BYTES
from towerflow.testing import wait_until

SECRET = Credentials(secret=b"test-secret")
SHAPES = {"emb": (40, 5), "w": (5, 3), "b": (3,)}


@pytest.fixture
def serve_ps(free_ports):
    """``serve_ps(options_of)``: two ps tasks served in this process -> (cluster, services).

    ``options_of(i)`` gives shard ``i``'s extra ``PSService`` options. Every
    server started is stopped at the end of the test.
    """
    servers = []

    def serve(options_of=lambda i: {}):
        ports = free_ports(3)
        cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                               "worker": [f"127.0.0.1:{ports[2]}"]})
        services = []
        for i in range(2):
            service = PSService(i, chunk_bytes=64, **options_of(i))
            server = Server(cluster, "ps", i, credentials=SECRET, start=False)
            server.add_handlers([service.handlers()])
            server.start()
            servers.append(server)
            services.append(service)
        return cluster, services

    try:
        yield serve
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def ps_cluster(serve_ps):
    """Two ps tasks served in this process; yields (cluster, services)."""
    return serve_ps()


def placement():
    return plan_placement(SHAPES, 2, partition_threshold_bytes=400)


def client(cluster, worker_id=0, **kw) -> PSClient:
    kw.setdefault("credentials", SECRET)
    kw.setdefault("chunk_bytes", 64)
    return PSClient(cluster, placement(), worker_id=worker_id, timeout=5.0, **kw)


def initial(plan):
    return [np.arange(s.numel, dtype=np.float32) for s in plan.shards]


def init(c: PSClient, **kw) -> list[np.ndarray]:
    values = initial(c.placement)
    kw.setdefault("total_num_replicas", 2)
    c.initialize(values, optimizer=pb.OptimizerSpec(name=kw.pop("opt", "sgd"), momentum=0.5),
                 aggregation=AggregationConfig(**kw))
    return values


def test_pull_and_push_through_two_shards(ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster) as c:
        values = init(c)
        into = [np.zeros_like(v) for v in values]
        assert c.pull(into) == 0
        for got, want in zip(into, values, strict=True):
            np.testing.assert_array_equal(got, want)
        ones = [np.ones_like(v) for v in values]
        result = c.push(ones, lr=0.5)
        assert result.applied and result.global_step == 1
        c.pull(into)
        for got, want in zip(into, values, strict=True):
            np.testing.assert_allclose(got, want - 0.5)
    assert [s.shard.state.stats.applied for s in services] == [1, 1]


def test_push_and_pull_in_one_round_trip(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with client(cluster) as c:
        values = init(c)
        fresh = [np.zeros_like(v) for v in values]
        result = c.push([np.full_like(v, 2.0) for v in values], lr=0.25, pull_into=fresh)
        assert result.global_step == 1
        for got, want in zip(fresh, values, strict=True):
            np.testing.assert_allclose(got, want - 0.5)
        assert [s.version for s in c.shards] == [1, 1]


def test_wrong_secret_is_refused_and_changes_nothing(ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster) as c:
        values = init(c)
    intruder = client(cluster, credentials=Credentials(secret=b"wrong"))
    try:
        with pytest.raises(UnauthenticatedError, match=r"UNAUTHENTICATED.*wrong credentials"):
            intruder.push([np.ones_like(v) for v in values], lr=1.0)
    finally:
        intruder.close(done=False)
    state = services[0].shard.state
    np.testing.assert_array_equal(state.params, values[0])
    assert state.step == 0 and state.stats.pushes == 0


def test_bad_gradient_raises_by_default_and_is_counted(ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster) as c:
        values = init(c)
        grads = [np.ones_like(v) for v in values]
        grads[0][-1] = np.inf
        with pytest.raises(InvalidArgumentError, match=r"NaN or inf in variable 'w' \(shape \[5, 3\]\)"):
            c.push(grads, lr=1.0)
        assert c.stats()[0]["refused"] == 1
    # the chunks before the one holding the inf were applied; no parameter is non-finite
    params = services[0].shard.state.params
    assert np.isfinite(params).all()
    np.testing.assert_array_equal(params[-1], values[0][-1])


def test_bad_gradient_skip_policy_returns_unapplied_result(ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster, on_bad_gradient="skip") as c:
        values = init(c)
        grads = [np.ones_like(v) for v in values]
        grads[1][0] = np.nan
        result = c.push(grads, lr=1.0)
    assert result.refused and not result.applied
    np.testing.assert_array_equal(services[1].shard.state.params, values[1])


def test_gradient_for_another_model_names_the_variable(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with client(cluster) as c:
        init(c)
    other = plan_placement({"emb": (40, 5), "w": (5, 4), "b": (4,)}, 2,
                           partition_threshold_bytes=400)
    with PSClient(cluster, other, worker_id=1, credentials=SECRET, timeout=5.0) as c:
        grads = [np.ones(s.numel, np.float32) for s in other.shards]
        with pytest.raises(InvalidArgumentError,
                           match=r"variable 'w' has shape \[5, 4\] but the parameter has shape \[5, 3\]"):
            c.push(grads, lr=1.0)


def test_retried_push_with_same_sequence_number_is_applied_once(ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster, worker_id=1) as c:
        values = init(c)
        shard = c.shards[0]
        grad = np.ones_like(values[0])
        first = shard.push(grad, worker_id=1, incarnation=c.incarnation, seq=9, lr=1.0)
        retry = shard.push(grad, worker_id=1, incarnation=c.incarnation, seq=9, lr=1.0)
    assert first.status == retry.status == "applied" and retry.duplicate
    state = services[0].shard.state
    assert state.step == 1 and state.stats.duplicates == 1
    np.testing.assert_allclose(state.params, values[0] - 1.0)


def test_ledger_lists_the_applied_pushes_of_every_shard(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with client(cluster, worker_id=1) as c:
        init(c)
        grads = [np.ones(s.numel, np.float32) for s in c.placement.shards]
        c.push(grads, lr=0.1)
        c.push(grads, lr=0.1)
        for reply in c.ledger():
            assert (reply.first, reply.total) == (0, 2)
            assert [(e.worker_id, e.incarnation, e.seq, e.step) for e in reply.entries] == \
                [(1, c.incarnation, 1, 1), (1, c.incarnation, 2, 2)]
        assert [len(r.entries) for r in c.ledger(since=1)] == [1, 1]


def replay_momentum(start: np.ndarray, grads) -> list[np.ndarray]:
    """The parameters after each of ``grads`` applied in turn by a momentum optimizer."""
    replay = make_optimizer("momentum", start.size, momentum=0.5)
    out = [start.copy()]
    for g in grads:
        out.append(out[-1].copy())
        replay.apply(out[-1], g, 0.5)
    return out[1:]


def test_push_stalled_then_cancelled_mid_stream_keeps_its_prefix_and_blocks_nobody(
        ps_cluster) -> None:
    """The chunks that arrived are applied; the stalled push holds no lock another push needs;
    after its call is cancelled its retry applies the rest, each element once."""
    cluster, services = ps_cluster
    with client(cluster, worker_id=1) as c, client(cluster, worker_id=0) as other:
        values = init(c)
        shard, state = c.shards[0], services[0].shard.state
        grad = (np.arange(state.layout.numel) % 7 + 1).astype(np.float32)  # 16-element chunks
        zeros = np.zeros_like(grad)
        # elements 0..47 see seq 4, seq 5, then the other worker's; the rest seq 4, the other
        # worker's, then seq 5 (the retry)
        head_order = replay_momentum(values[0], (grad, grad, zeros))
        tail_order = replay_momentum(values[0], (grad, zeros, grad))
        expected = [tail_order[0], np.concatenate([head_order[2][:48], tail_order[1][48:]]),
                    np.concatenate([head_order[2][:48], tail_order[2][48:]])]
        prefix = head_order[1][:48]
        earlier = shard.push(grad, worker_id=1, incarnation=c.incarnation, seq=4, lr=0.5)
        assert earlier.status == "applied" and earlier.step == 1
        head = pb.PushRequest(worker_id=1, incarnation=c.incarnation, seq=5, lr=0.5,
                              dtype="float32", numel=grad.size, finite=True)
        release = threading.Event()

        def three_chunks_then_stall():
            yield head.SerializeToString()
            for start in (0, 16, 32):
                yield grad[start:start + 16].tobytes()
            release.wait(10)

        call = shard.channel.stream_unary("/towerflow.ps.PS/Push").future(
            three_chunks_then_stall(), timeout=10)
        try:
            wait_until(lambda: np.array_equal(state.params[:48], prefix),
                       timeout=10.0, what="the three chunks applied on arrival")
            np.testing.assert_array_equal(state.params[48:], expected[0][48:])  # only seq 4
            assert shard.status().staged_bytes == 0  # nothing of it held
            # another worker's push-and-pull is not held by the stalled push
            fresh = [np.empty(s.numel, np.float32) for s in other.placement.shards]
            result = other.push([np.zeros(s.numel, np.float32) for s in other.placement.shards],
                                lr=0.5, pull_into=fresh)
            assert result.applied and result.global_step == 2
            call.cancel()  # the worker goes away part way through its push
        finally:
            release.set()
        wait_until(lambda: shard.status().staged_bytes == 0,
                   timeout=10.0, what="the staged bytes released")
        assert state.step == 2 and [e[:3] for e in state.ledger] == [
            (1, c.incarnation, 4), (0, other.incarnation, 1)]
        again = shard.push(grad, worker_id=1, incarnation=c.incarnation, seq=4, lr=0.5)
        assert again.status == "applied" and again.duplicate  # not applied a second time
        retry = shard.push(grad, worker_id=1, incarnation=c.incarnation, seq=5, lr=0.5)
        assert retry.status == "applied" and retry.step == 3 and not retry.duplicate
        entries = c.ledger()[0].entries
        assert [(e.seq, e.partial, e.applied_stop) for e in entries if e.worker_id == 1] == \
            [(4, False, grad.size), (5, False, grad.size)]
    np.testing.assert_array_equal(state.params, expected[2])


def test_non_chief_waits_until_the_chief_initialises(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with client(cluster, worker_id=1) as waiter, client(cluster) as chief:
        with pytest.raises(DeadlineExceededError, match=r"waited 0 s for the chief.*not initialised"):
            waiter.wait_until_initialized(timeout=0.2, poll=0.05)
        result: dict[str, int] = {}
        thread = threading.Thread(
            target=lambda: result.setdefault("step", waiter.wait_until_initialized(10, 0.05)))
        thread.start()
        try:
            time.sleep(0.2)  # the waiter polls meanwhile; initialising later must release it
            assert thread.is_alive()
            chief.initialize(initial(chief.placement), optimizer=pb.OptimizerSpec(name="sgd"),
                             aggregation=AggregationConfig(), step=7)
        finally:
            thread.join(10)
        assert result == {"step": 7}


def test_worker_with_another_model_refuses_to_start(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with client(cluster) as c:
        init(c)
    other = plan_placement({"x": (3,)}, 2)
    with PSClient(cluster, other, worker_id=1, credentials=SECRET, timeout=5.0) as c:
        with pytest.raises(InvalidArgumentError, match=r"run the same model on every worker"):
            c.wait_until_initialized(timeout=5)


def test_push_before_initialisation_is_a_failed_precondition(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with client(cluster) as c:
        with pytest.raises(FailedPreconditionError, match=r"not initialised yet"):
            c.pull([np.zeros(s.numel, np.float32) for s in c.placement.shards])


def test_snapshot_and_restore_keep_optimizer_state(ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster) as c:
        values = init(c, opt="momentum")
        c.push([np.ones_like(v) for v in values], lr=0.1)
        snap = c.snapshot()
        assert snap[0].step == 1 and snap[0].optimizer_step == 1
        np.testing.assert_allclose(snap[0].slots["momentum_buffer"], 1.0)
        c.initialize([s.params for s in snap], optimizer=pb.OptimizerSpec(name="momentum", momentum=0.5),
                     aggregation=AggregationConfig(), step=snap[0].step,
                     slots=[s.slots for s in snap], optimizer_step=snap[0].optimizer_step)
        c.push([np.ones_like(v) for v in values], lr=0.1)
    state = services[0].shard.state
    # momentum continued from the restored buffer: 0.5 * 1 + 1 = 1.5
    np.testing.assert_allclose(state.optimizer.slots["momentum_buffer"], 1.5)
    np.testing.assert_allclose(state.params, values[0] - 0.1 - 0.15, rtol=1e-6)
    assert state.step == 2


_PS_MAIN = """
import sys
from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.ps import run_ps_task
sys.exit(run_ps_task(ClusterSpec.from_tf_config()[0], TaskInfo("ps", 0), Credentials(secret=b"s")))
"""


@pytest.mark.slow
def test_dead_ps_gives_unavailable_within_the_deadline(free_ports, python, subprocess_env) -> None:
    ports = free_ports(2)
    spec = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    env = dict(subprocess_env, TF_CONFIG=json.dumps({"cluster": spec,
                                                    "task": {"type": "ps", "index": 0}}))
    proc = subprocess.Popen([python, "-c", _PS_MAIN], env=env, stderr=subprocess.PIPE, text=True)
    plan = plan_placement({"w": (4,)}, 1)
    c = PSClient(ClusterSpec(spec), plan, worker_id=0, credentials=Credentials(secret=b"s"),
                 timeout=2.0)
    try:
        c.shards[0]._retrying(c.shards[0].status, 30)  # the ps is up
        c.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                     aggregation=AggregationConfig())
        assert c.push([np.ones(4, np.float32)], lr=1.0).applied
        assert c.shards[0]._stream is not None  # the push stream is open when the ps dies
        proc.kill()
        proc.wait(10)
        start = time.monotonic()
        with pytest.raises(UnavailableError, match=r"UNAVAILABLE"):
            c.push([np.ones(4, np.float32)], lr=1.0)
        assert time.monotonic() - start < 10
    finally:
        c.close(done=False)
        proc.kill()
        proc.wait(10)


def test_small_shards_push_and_pull_in_one_message_each_way(ps_cluster) -> None:
    cluster, services = ps_cluster
    with PSClient(cluster, placement(), worker_id=0, credentials=SECRET, timeout=5.0) as c:
        assert all(s.layout.nbytes <= s.chunk_bytes for s in c.shards)  # the unary path
        values = init(c)
        fresh = [np.zeros_like(v) for v in values]
        assert c.push([np.ones_like(v) for v in values], lr=1.0, pull_into=fresh).applied
        for got, want in zip(fresh, values, strict=True):
            np.testing.assert_allclose(got, want - 1.0)
        bad = [np.ones_like(v) for v in values]
        bad[1][2] = np.nan
        with pytest.raises(InvalidArgumentError, match=r"NaN or inf in variable"):
            c.push(bad, lr=1.0, pull_into=fresh)
    assert services[1].shard.state.stats.refused == 1
    np.testing.assert_allclose(services[1].shard.state.params, values[1] - 1.0)


def test_replica_task_maps_replicas_to_the_chief_and_the_workers() -> None:
    from towerflow.ps.server.dense.service import replica_task

    with_chief = ClusterSpec({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"],
                              "worker": ["127.0.0.1:3", "127.0.0.1:4"]})
    assert [str(replica_task(with_chief, r)) for r in range(3)] == \
        ["chief:0", "worker:0", "worker:1"]
    assert replica_task(with_chief, 3) is None
    without = ClusterSpec({"ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]})
    assert replica_task(without, 0).device_name == "/job:worker/replica:0/task:0"


def test_closing_client_tells_every_shard_its_worker_is_done(serve_ps) -> None:
    finished: list[tuple[int, int]] = []
    cluster, _ = serve_ps(lambda i: {"on_worker_done": lambda w: finished.append((i, w))})
    c = client(cluster, worker_id=1)
    init(c)
    assert finished == []
    c.close()
    assert sorted(finished) == [(0, 1), (1, 1)]


def small_client(cluster, **kw) -> PSClient:
    """A client whose shards all fit in one message: pushes go over the push stream."""
    c = client(cluster, chunk_bytes=CHUNK_BYTES, **kw)
    assert all(s.layout.nbytes <= s.chunk_bytes for s in c.shards)
    return c


def test_small_pushes_reuse_one_stream_across_steps(ps_cluster) -> None:
    cluster, services = ps_cluster
    with small_client(cluster) as c:
        values = init(c)
        fresh = [np.zeros_like(v) for v in values]
        assert c.push([np.ones_like(v) for v in values], lr=1.0, pull_into=fresh).applied
        streams = [s._stream for s in c.shards]
        assert all(streams)
        for _ in range(3):
            assert c.push([np.ones_like(v) for v in values], lr=1.0, pull_into=fresh).applied
        assert [s._stream for s in c.shards] == streams
        for got, service in zip(fresh, services, strict=True):
            np.testing.assert_array_equal(got, service.shard.state.params)
        assert [r.total for r in c.ledger()] == [4, 4]
    assert all(s._stream is None for s in c.shards)  # close() ended the streams


def test_refused_small_push_raises_and_the_stream_carries_later_pushes(ps_cluster) -> None:
    cluster, services = ps_cluster
    with small_client(cluster) as c:
        values = init(c)
        fresh = [np.zeros_like(v) for v in values]
        assert c.push([np.ones_like(v) for v in values], lr=1.0, pull_into=fresh).applied
        streams = [s._stream for s in c.shards]
        bad = [np.ones_like(v) for v in values]
        bad[0][1] = np.inf
        with pytest.raises(InvalidArgumentError, match=r"NaN or inf in variable"):
            c.push(bad, lr=1.0, pull_into=fresh)
        assert [s._stream for s in c.shards] == streams
        assert c.push([np.ones_like(v) for v in values], lr=1.0, pull_into=fresh).applied
    assert services[0].shard.state.stats.refused == 1
    assert [s.shard.state.step for s in services] == [2, 3]  # only shard 0 refused it


def test_small_push_failing_on_the_stream_raises_its_error_and_reopens(ps_cluster) -> None:
    cluster, _ = ps_cluster
    with small_client(cluster) as c:
        with pytest.raises(FailedPreconditionError, match=r"not initialised yet"):
            c.push([np.ones(s.layout.numel, np.float32) for s in c.shards], lr=1.0)
        assert c.shards[0]._stream is None  # the failed call ended the stream
        values = init(c)
        assert c.push([np.ones_like(v) for v in values], lr=1.0).applied


def test_small_push_retried_on_a_fresh_stream_is_applied_once(ps_cluster) -> None:
    cluster, services = ps_cluster
    with small_client(cluster) as c:
        values = init(c)
        shard = c.shards[0]
        grad = np.ones_like(values[0])
        first = shard.push(grad, worker_id=0, incarnation=c.incarnation, seq=5, lr=1.0)
        shard.close_stream()  # the stream broke after the ps applied the push
        retry = shard.push(grad, worker_id=0, incarnation=c.incarnation, seq=5, lr=1.0)
    assert first.status == retry.status == "applied" and retry.duplicate
    state = services[0].shard.state
    assert state.step == 1 and state.stats.duplicates == 1
    np.testing.assert_allclose(state.params, values[0] - 1.0)


def test_a_wait_for_a_missing_ps_says_so_then_gives_up_in_one_sentence(free_ports,
                                                                      caplog) -> None:
    ports = free_ports(2)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    c = PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=0, credentials=SECRET,
                 timeout=0.5)
    try:
        with caplog.at_level("INFO", logger="towerflow.ps"), \
                pytest.raises(UnavailableError, match=rf"^the ps task at 127\.0\.0\.1:{ports[0]} "
                              r"did not answer for [4-7] s: call .* failed with UNAVAILABLE"):
            c.shards[0]._retrying(c.shards[0].status, 6.0)
    finally:
        c.close()
    assert any(f"waiting for the ps task at 127.0.0.1:{ports[0]} to answer" in r.getMessage()
               for r in caplog.records)


def test_a_chief_failure_before_init_reaches_waiting_workers_until_an_init_clears_it(
        ps_cluster) -> None:
    from towerflow.errors import AbortedError
    from towerflow.ps.worker.dense.client import tell_chief_failure

    cluster, services = ps_cluster
    with client(cluster, worker_id=1) as other:  # a worker is no chief: its failure is ignored
        other.close(done=False, failure="RuntimeError: not the chief")
    assert [s.failure for s in services] == ["", ""]
    # the chief fails before it has a client (e.g. its model was refused at declaration)
    tell_chief_failure(cluster, SECRET, "CheckpointError: bad\x07 digest\nTraceback (most ...")
    assert [s.failure for s in services] == ["CheckpointError: bad  digest"] * 2
    waiting = client(cluster, worker_id=1)
    with pytest.raises(AbortedError, match=r"^The chief failed before it initialised the job "
                       r"\(ps task 0 says so\): CheckpointError: bad  digest\. Fix the chief"):
        waiting.wait_until_initialized(timeout=5)
    assert all(1 in s.finished for s in services)  # it said Done: the ps tasks may end
    with client(cluster) as chief:  # the chief restarted and initialised: the failure is gone
        init(chief)
        tell_chief_failure(cluster, SECRET, "RuntimeError: too late")  # after Init: ignored
        assert [s.failure for s in services] == ["", ""]
        with client(cluster, worker_id=1) as again:
            assert again.wait_until_initialized(timeout=5) == 0


def test_small_shards_are_pushed_side_by_side_and_a_broken_stream_is_pushed_again_once(
        ps_cluster) -> None:
    cluster, services = ps_cluster
    with client(cluster, chunk_bytes=1 << 20) as c:  # every shard fits one message
        assert all(shard.small for shard in c.shards)
        values = init(c, opt="sgd")
        fresh = [np.zeros_like(v) for v in values]
        result = c.push([np.ones_like(v) for v in values], lr=0.5, pull_into=fresh)
        assert result.applied and result.global_step == 1
        for got, want in zip(fresh, values, strict=True):
            np.testing.assert_allclose(got, want - 0.5)
        # shard 0's request is on its way, then its stream breaks before the reply is read
        grads = [np.ones_like(v) for v in values]
        ident = {"worker_id": 0, "incarnation": c.incarnation, "seq": 2, "lr": 0.5}
        request = c.shards[0].encode_small(grads[0], want_params=True, **ident)
        assert c.shards[0].start_push(request)
        c.shards[0]._stream._call.cancel()  # the ps may have applied it or not: either way once
        reply = c.shards[0].finish_push(request, pull_into=fresh[0])
        assert reply.status == "applied"
        assert services[0].shard.state.stats.applied == 2  # the push and its retry: applied once
        np.testing.assert_allclose(fresh[0], values[0] - 1.25)  # momentum 0.5: 0.5 + 0.75
        c.shards[1].push(grads[1], **ident)  # the same step's other shard


def _steps(services) -> list[int]:
    return [s.shard.state.step for s in services]


@pytest.mark.parametrize("sync", [True, False], ids=["sync-client", "plain-client"])
def test_sync_shards_a_step_apart_meet_again(ps_cluster, sync) -> None:
    """A worker stopped between its pushes leaves shard 0 a step ahead of shard 1: the next
    worker's push goes to shard 1 only, and from then on both complete the same steps
    (a client that pushes each shard its own step keeps them a step apart for good)."""
    from towerflow.ps.worker.dense.variables import consistent_snapshot

    cluster, services = ps_cluster
    with client(cluster, 0, sync=sync) as chief, client(cluster, 1, sync=sync) as other:
        values = init(chief, mode="sync", replicas_to_aggregate=1)
        ones = [np.ones_like(v) for v in values]
        chief.pull([np.zeros_like(v) for v in values])
        # the chief's push reached ps task 0 only (it stopped before its push to task 1)
        chief.shards[0].push(ones[0], worker_id=0, incarnation=chief.incarnation, seq=99, lr=0.5)
        assert _steps(services) == [1, 0]
        into = [np.zeros_like(v) for v in values]
        other.pull(into)
        result = other.push(ones, lr=0.5, pull_into=into)
        if not sync:  # the old way: each shard its own step, a step apart from now on
            assert result.statuses == ("applied", "applied") and _steps(services) == [2, 1]
            return
        assert result.statuses == ("stale", "applied"), result.messages
        assert re.search(r"step 1 of ps task 0 but of step 0 of ps task 1: sent to the tasks "
                         r"at step 0 only", result.messages[0])
        assert _steps(services) == [1, 1] and services[0].shard.state.stats.stale == 0
        np.testing.assert_allclose(into[1], values[1] - 0.5)  # the step shard 1 lacked
        for _ in range(3):
            assert other.push(ones, lr=0.5, pull_into=into).applied
        assert _steps(services) == [4, 4]
        snaps = consistent_snapshot(other, sync=True, timeout=1.0)
        assert [s.step for s in snaps] == [4, 4]
        # four steps of gradient 1 on each shard, SGD at 0.5 with momentum 0.5
        moved = 0.5 * (1 + 1.5 + 1.75 + 1.875)
        for snap, start in zip(snaps, values, strict=True):
            np.testing.assert_allclose(snap.params, start - moved)


def test_a_small_sync_push_out_of_time_raises_once_push_wait_has_passed(ps_cluster) -> None:
    """Small shards' pushes go out on their streams side by side; a sync step that waits
    for a replica past the push's deadline (``push_wait=0``: no second attempt) raises
    instead of being sent again."""
    cluster, services = ps_cluster
    with client(cluster, chunk_bytes=1 << 20, push_timeout=0.5, push_wait=0.0) as c:
        values = init(c, mode="sync")  # two replicas: worker 1 never pushes
        sent_again = []
        for shard in c.shards:
            shard.push_small = lambda *args, **kw: sent_again.append(args)  # type: ignore
        with pytest.raises(DeadlineExceededError):
            c.push([np.ones_like(v) for v in values], lr=0.5)
        assert sent_again == []  # each shard's one attempt, on its stream, then the error
        assert [s.shard.state.step for s in services] == [0, 0]
