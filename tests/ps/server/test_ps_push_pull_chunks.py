"""An async push-and-pull applies its gradient chunk by chunk as it arrives, then streams
the parameters back chunk by chunk.

A bad chunk ends the push (the chunks before it stay applied; no parameters
are sent), and a reply cut off at any point leaves the gradient applied whole, once.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from towerflow.cluster import ClusterSpec, Server
from towerflow.cluster.transport import Credentials
from towerflow.ps import PSClient, PSService, plan_placement
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.server.pushes import APPLIED, REFUSED, PushHeader
from towerflow.ps.wire import ps_pb2 as pb

NUMEL = 1000
CHUNK = 64 * 4  # reply ranges of 64 elements
SPLIT = (0, 300, 600, NUMEL)  # payload chunks of 300, 300 and 400 elements


def make(mode: str = "async", optimizer: str = "momentum"):
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    opt = make_optimizer(optimizer, NUMEL, momentum=0.9) if optimizer == "momentum" else \
        make_optimizer(optimizer, NUMEL)
    state = ShardState(layout, np.linspace(-1, 1, NUMEL, dtype=np.float32), opt)
    return state, DenseShard(state, AggregationConfig(mode, total_num_replicas=2))


def gradient(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(NUMEL).astype(np.float32)


def header(state: ShardState, worker: int = 0, seq: int = 1) -> PushHeader:
    return PushHeader(worker, seq, state.step, 0.1, NUMEL, incarnation=7,
                      segments=state.layout.signature)


def chunks(grad: np.ndarray) -> list[bytes]:
    return [grad[a:b].tobytes() for a, b in zip(SPLIT, SPLIT[1:], strict=False)]


def reference(*grads: np.ndarray) -> np.ndarray:
    """The parameters after applying ``grads`` one by one with plain pushes."""
    state, shard = make()
    for seq, grad in enumerate(grads, 1):
        assert shard.push(header(state, seq=seq), chunks(grad))[0].status == APPLIED
    return state.params.copy()


def test_the_reply_carries_every_range_updated_and_equals_a_plain_push() -> None:
    state, shard = make()
    grad = gradient(1)
    outcome, reply = shard.push(header(state), chunks(grad), want_params=True, chunk_bytes=CHUNK)
    assert outcome.status == APPLIED and outcome.step == 1
    sent = np.frombuffer(b"".join(reply), np.float32)
    expected = reference(grad)
    np.testing.assert_array_equal(sent, expected)
    np.testing.assert_array_equal(state.params, expected)
    assert state.step == 1 and state.staged == 0 and state.ledger == [(0, 7, 1, 1)]


def test_a_reply_abandoned_after_its_first_range_leaves_the_gradient_applied_whole_once(
        ) -> None:
    state, shard = make()
    grad = gradient(2)
    _, reply = shard.push(header(state), chunks(grad), want_params=True, chunk_bytes=CHUNK)
    stream = iter(reply)
    first = np.frombuffer(next(stream), np.float32)
    np.testing.assert_array_equal(first, reference(grad)[:64])
    stream.close()  # the caller went away
    np.testing.assert_array_equal(state.params, reference(grad))
    assert state.step == 1 and state.staged == 0
    again, _ = shard.push(header(state), chunks(grad))
    assert again.status == APPLIED and again.duplicate
    np.testing.assert_array_equal(state.params, reference(grad))


def test_a_reply_never_read_leaves_the_gradient_applied_whole() -> None:
    state, shard = make()
    grad = gradient(3)
    _, reply = shard.push(header(state), chunks(grad), want_params=True, chunk_bytes=CHUNK)
    del reply  # the call ended before the reply was read
    np.testing.assert_array_equal(state.params, reference(grad))
    assert state.step == 1 and state.stats.applied == 1


def test_a_bad_gradient_in_its_last_chunk_applies_the_chunks_before_and_sends_no_parameters(
        ) -> None:
    state, shard = make()
    before = state.params.copy()
    grad = gradient(4)
    grad[NUMEL - 1] = np.nan
    outcome, reply = shard.push(header(state), chunks(grad), want_params=True, chunk_bytes=CHUNK)
    assert outcome.status == REFUSED and "NaN" in outcome.message and list(reply) == []
    assert f"first {SPLIT[2]} of {NUMEL} values were applied" in outcome.message
    np.testing.assert_array_equal(state.params[:SPLIT[2]], reference(_head(grad))[:SPLIT[2]])
    np.testing.assert_array_equal(state.params[SPLIT[2]:], before[SPLIT[2]:])
    assert np.isfinite(state.params).all() and state.step == 0 and state.staged == 0


def _head(grad: np.ndarray) -> np.ndarray:
    """``grad`` with its last chunk zeroed (what a push refused at that chunk applied)."""
    kept = grad.copy()
    kept[SPLIT[2]:] = 0.0
    return kept


def test_two_streamed_pushes_interleaved_are_each_applied_once() -> None:
    state, shard = make(optimizer="sgd")
    g1, g2 = gradient(5), gradient(6)
    o1, r1 = shard.push(header(state, worker=0), chunks(g1), want_params=True, chunk_bytes=CHUNK)
    o2, r2 = shard.push(header(state, worker=1), chunks(g2), want_params=True, chunk_bytes=CHUNK)
    assert (o1.step, o2.step) == (1, 2)
    s1, s2 = iter(r1), iter(r2)
    next(s1), next(s2), next(s1)
    for _ in s2:
        pass
    for _ in s1:
        pass
    expected = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    expected -= np.float32(0.1) * g1
    expected -= np.float32(0.1) * g2
    np.testing.assert_allclose(state.params, expected, rtol=0, atol=1e-6)
    assert state.step == 2 and sorted(r[:3] for r in state.ledger) == [(0, 7, 1), (1, 7, 1)]


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sync_and_ssp_reply_after_the_update(mode) -> None:
    state, shard = make(mode)
    shard.worker_done(1)  # one live replica: a sync step needs one gradient
    grad = gradient(7)
    outcome, reply = shard.push(header(state), chunks(grad), want_params=True, chunk_bytes=CHUNK)
    assert outcome.status == APPLIED and state.step == 1
    np.testing.assert_array_equal(np.frombuffer(b"".join(reply), np.float32), state.params)


def test_a_push_and_pull_call_cancelled_after_its_reply_header_applies_the_gradient_once(
        free_ports) -> None:
    ports = free_ports(2)
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    secret = Credentials(secret=b"streamed-apply")
    service = PSService(0, chunk_bytes=CHUNK)
    server = Server(cluster, "ps", 0, credentials=secret, start=False)
    server.add_handlers([service.handlers()])
    server.start()
    plan = plan_placement({"w": (NUMEL,)}, 1)
    try:
        with PSClient(cluster, plan, worker_id=0, timeout=5.0, credentials=secret) as c:
            start = np.linspace(-1, 1, NUMEL, dtype=np.float32)
            c.initialize([start], optimizer=pb.OptimizerSpec(name="sgd"),
                         aggregation=AggregationConfig("async", total_num_replicas=1))
            grad = gradient(8)
            head = pb.PushRequest(worker_id=0, incarnation=c.incarnation, seq=1, lr=0.1,
                                  dtype="float32", numel=NUMEL, finite=True, want_params=True)
            call = c.shards[0].channel.stream_stream("/towerflow.ps.PS/PushPull")(
                iter([head.SerializeToString(), *chunks(grad)]), timeout=10)
            reply = pb.PushReply.FromString(next(call))
            assert reply.status == APPLIED
            call.cancel()  # the worker goes away without reading the parameters
            state = service.shard.state
            deadline = time.monotonic() + 10
            while state.step != 1:
                assert time.monotonic() < deadline, "the cut-off reply's gradient was not applied"
                time.sleep(0.01)
            expected = start - np.float32(0.1) * grad
            np.testing.assert_array_equal(state.params, expected)
            again = c.shards[0].push(grad, worker_id=0, incarnation=c.incarnation, seq=1, lr=0.1)
            assert again.status == "applied" and again.duplicate and state.step == 1
    finally:
        server.stop()
