"""Aggregation modes of a ps shard (async, sync with backups, ssp), driven by threads."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from towerflow.errors import DeadlineExceededError, InvalidArgumentError
from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.wire.calls import APPLIED, REFUSED, STALE, VOIDED
from towerflow.ps.wire.messages import PushHeader
from towerflow.testing import wait_until

NUMEL = 6


def make(mode: str, **cfg):
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    state = ShardState(layout, np.zeros(NUMEL, np.float32), make_optimizer("sgd", NUMEL))
    return state, DenseShard(state, AggregationConfig(mode=mode, **cfg)).aggregator


class Worker:
    """Pushes constant gradients with increasing sequence numbers."""

    def __init__(self, state: ShardState, agg, worker_id: int) -> None:
        self.state, self.agg, self.worker_id, self.seq = state, agg, worker_id, 0

    def push(self, value: float, token: int | None = None, payload=None):
        self.seq += 1
        head = PushHeader(self.worker_id, self.seq, self.state.step if token is None else token,
                          1.0, NUMEL, segments=self.state.layout.signature)
        data = payload if payload is not None else [np.full(NUMEL, value, np.float32).tobytes()]
        return self.agg.push(head, data)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Unknown ps mode 'bulk'"):
        AggregationConfig(mode="bulk")
    with pytest.raises(InvalidArgumentError, match=r"replicas_to_aggregate=3 must be between 1"):
        AggregationConfig(mode="sync", total_num_replicas=2, replicas_to_aggregate=3)


def test_async_applies_every_push_from_concurrent_workers() -> None:
    state, agg = make("async", total_num_replicas=2)
    workers = [Worker(state, agg, w) for w in range(2)]
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda w: [w.push(1.0) for _ in range(20)], workers))
    steps = sorted(o.step for out in outcomes for o in out)
    assert steps == list(range(1, 41))
    np.testing.assert_allclose(state.params, -40.0)
    assert state.stats.applied == 40


def test_sync_averages_one_gradient_per_replica_and_applies_once() -> None:
    state, agg = make("sync", total_num_replicas=2)
    w0, w1 = Worker(state, agg, 0), Worker(state, agg, 1)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(w0.push, 2.0)
        wait_until(lambda: agg.counted == 1, timeout=10.0, what="one push counted")
        assert not pending.done() and state.step == 0  # waits for the other replica
        second = w1.push(4.0)
        first = pending.result(timeout=10)
    assert first.status == second.status == APPLIED and first.step == second.step == 1
    np.testing.assert_allclose(state.params, -3.0)  # mean of 2 and 4, lr 1
    assert state.stats.updates == state.step == 1


def test_sync_drops_and_counts_stale_gradients() -> None:
    state, agg = make("sync", total_num_replicas=1)
    worker = Worker(state, agg, 0)
    for _ in range(3):
        assert worker.push(1.0).status == APPLIED
    stale = worker.push(1.0, token=1)
    assert stale.status == STALE and "computed on step 1" in stale.message
    assert state.stats.stale == 1
    assert state.step == state.stats.updates == 3
    np.testing.assert_allclose(state.params, -3.0)


def test_sync_backup_worker_does_not_hold_the_step() -> None:
    state, agg = make("sync", total_num_replicas=3, replicas_to_aggregate=2)
    fast = [Worker(state, agg, 0), Worker(state, agg, 1)]
    slow = Worker(state, agg, 2)
    slow_token = state.step
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            outcomes = list(pool.map(lambda w: w.push(1.0), fast))
            assert all(o.status == APPLIED for o in outcomes)
    assert state.step == 3
    late = slow.push(1.0, token=slow_token)
    assert late.status == STALE and state.stats.stale == 1


def test_sync_step_waits_up_to_deadline_then_names_missing_worker() -> None:
    state, agg = make("sync", total_num_replicas=2, timeout=0.3)
    with pytest.raises(DeadlineExceededError, match=r"received 1 \(from worker 0\); missing: /job:worker/task:1"):
        Worker(state, agg, 0).push(1.0)
    assert state.step == 0


def test_sync_finished_worker_no_longer_holds_the_step() -> None:
    state, agg = make("sync", total_num_replicas=2)
    w0 = Worker(state, agg, 0)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(w0.push, 1.0)
        wait_until(lambda: agg.counted == 1, timeout=10.0, what="one push counted")
        agg.worker_done(1)
        assert pending.result(timeout=10).status == APPLIED
    assert state.step == 1


def test_sync_nan_chunk_voids_the_step_and_the_step_computed_again_is_correct() -> None:
    """A NaN found part way through a push (its first chunk already summed) voids the step:
    every push of it is answered voided, the sum is reset, the recomputed step is exact."""
    state, agg = make("sync", total_num_replicas=2)
    w0, w1 = Worker(state, agg, 0), Worker(state, agg, 1)
    bad = [np.ones(3, np.float32).tobytes(), np.array([1, np.nan, 1], np.float32).tobytes()]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(w0.push, 1.0)
        wait_until(lambda: agg.counted == 1, timeout=10.0, what="one push counted")
        voided = w1.push(0.0, payload=bad)
        assert voided.status == VOIDED
        assert re.search(r"step 0 .* voided: the gradient pushed by worker 1 contains NaN or "
                         r"inf at element 4 in variable 'w'", voided.message)
        assert pending.result(timeout=10).status == VOIDED
        assert pending.result().message == voided.message
        assert agg.counted == 0 and state.step == 0 and state.stats.voided == 2
        np.testing.assert_array_equal(state.params, 0.0)
        again = pool.submit(w0.push, 1.0)  # both compute the step again
        assert w1.push(3.0).status == APPLIED
        assert again.result(timeout=10).status == APPLIED
    np.testing.assert_allclose(state.params, -2.0)  # the average of 1 and 3: nothing stale
    assert state.step == 1


def test_ssp_bound_holds_with_a_slow_worker() -> None:
    staleness = 2
    state, agg = make("ssp", total_num_replicas=2, staleness=staleness)
    fast, slow = Worker(state, agg, 0), Worker(state, agg, 1)
    progress = []
    stop = threading.Event()

    def run_fast() -> None:
        for _ in range(8):
            fast.push(1.0)
            progress.append(fast.seq)
        stop.set()

    thread = threading.Thread(target=run_fast)
    thread.start()
    try:
        wait_until(lambda: len(progress) >= staleness,
                   timeout=10.0, what="the fast worker's pushes")
        # the fast worker is now blocked: it may not run further ahead of the slow one
        wait_until(lambda: agg._clocks[0] == staleness + 1,
                   timeout=10.0, what="the fast worker blocked")
        assert len(progress) == staleness and not stop.is_set()
        for _ in range(8):
            slow.push(1.0)
            assert agg._clocks[0] - agg._clocks[1] <= staleness + 1
        thread.join(10)
        assert stop.is_set()
    finally:
        agg.worker_done(1)
        thread.join(10)
    assert state.stats.max_lead == staleness
    assert state.step == 16


def test_ssp_wait_for_slowest_has_a_deadline() -> None:
    state, agg = make("ssp", total_num_replicas=2, staleness=0, timeout=0.3)
    with pytest.raises(DeadlineExceededError, match=r"slowest workers \(1, at push 0\)"):
        Worker(state, agg, 0).push(1.0)
    assert state.step == 1  # applied, only the return was held


def test_closing_a_replaced_shard_releases_waiting_pushes() -> None:
    state, agg = make("sync", total_num_replicas=2)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(Worker(state, agg, 0).push, 1.0)
        wait_until(lambda: agg.counted == 1, timeout=10.0, what="one push counted")
        agg.close()
        assert pending.result(timeout=10).status == VOIDED
    assert state.step == 0


def streamed(state: ShardState, worker: int, seq: int = 1, incarnation: int = 0) -> PushHeader:
    """The header of a push whose sender vouched that it is finite."""
    return PushHeader(worker, seq, state.step, 1.0, NUMEL, incarnation=incarnation,
                      segments=state.layout.signature, finite=True)


def halves(value: float, first_done: threading.Event | None = None,
           release: threading.Event | None = None, fail: bool = False):
    """Yield a gradient in two chunks, optionally pausing (or failing) between them."""
    yield np.full(NUMEL // 2, value, np.float32).tobytes()
    if first_done is not None:
        first_done.set()
    if release is not None:
        assert release.wait(10)
    if fail:
        raise ConnectionResetError("the worker went away")
    yield np.full(NUMEL // 2, value, np.float32).tobytes()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_push_stalled_half_way_holds_no_other_push_and_counts_once_whole(mode) -> None:
    state, agg = make(mode, total_num_replicas=2)
    first_done, release = threading.Event(), threading.Event()
    half = NUMEL // 2
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(agg.push, streamed(state, 0), halves(1.0, first_done, release))
        assert first_done.wait(10)
        wait_until(lambda: state.params[0] == -1.0,
                   timeout=10.0, what="its first chunk applied as it arrived")
        assert state.staged == 0 and state.step == 0  # nothing held; no update counted yet
        np.testing.assert_array_equal(state.params[half:], 0.0)
        other = agg.push(streamed(state, 1), halves(2.0))  # not held by the unfinished push
        assert other.status == APPLIED and other.step == 1
        np.testing.assert_array_equal(state.params[:half], -3.0)
        np.testing.assert_array_equal(state.params[half:], -2.0)
        release.set()
        late = slow.result(timeout=10)
    assert late.status == APPLIED and late.step == 2
    np.testing.assert_array_equal(state.params, -3.0)
    assert state.optimizer.step == 2 and state.staged == 0


def test_sync_a_push_beyond_the_replicas_to_aggregate_waits_and_is_stale() -> None:
    """With one gradient to aggregate, a second replica's push waits before any of its bytes
    is summed and is stale once the admitted push completes the step."""
    state, agg = make("sync", total_num_replicas=2, replicas_to_aggregate=1)
    first_done, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(agg.push, streamed(state, 0), halves(1.0, first_done, release))
        assert first_done.wait(10)
        sent = threading.Event()

        def other_payload():
            sent.set()
            yield np.full(NUMEL, 2.0, np.float32).tobytes()

        other = pool.submit(agg.push, streamed(state, 1), other_payload())
        release.set()
        assert slow.result(timeout=10).status == APPLIED
        assert other.result(timeout=10).status == STALE
    assert not sent.is_set()  # none of the stale push's bytes was read
    np.testing.assert_array_equal(state.params, -1.0)
    assert state.step == 1 and state.staged == 0


def test_a_push_cut_off_part_way_keeps_its_prefix_and_its_retry_applies_the_rest() -> None:
    state, agg = make("async", total_num_replicas=1)
    with pytest.raises(ConnectionResetError):
        agg.push(streamed(state, 0, seq=4, incarnation=7), halves(1.0, fail=True))
    np.testing.assert_array_equal(state.params[:NUMEL // 2], -1.0)
    np.testing.assert_array_equal(state.params[NUMEL // 2:], 0.0)
    assert state.step == 0 and list(state.ledger) == [] and state.staged == 0
    retry = agg.push(streamed(state, 0, seq=4, incarnation=7), halves(1.0))
    assert retry.status == APPLIED and retry.step == 1 and not retry.duplicate
    np.testing.assert_array_equal(state.params, -1.0)
    assert list(state.ledger) == [(0, 7, 4, 1)] and state.optimizer.step == 1
    again = agg.push(streamed(state, 0, seq=4, incarnation=7), halves(1.0))
    assert again.duplicate and state.step == 1


@pytest.mark.parametrize("finite", [True, False])
def test_a_push_with_nan_in_a_later_chunk_applies_the_chunks_before_it(finite) -> None:
    """Chunk by chunk, whatever the header said about the values: the chunks before the bad
    one stay applied, the rest is refused, and the parameters hold no NaN."""
    state, agg = make("async", total_num_replicas=1)
    bad = [np.ones(2, np.float32).tobytes(), np.ones(2, np.float32).tobytes(),
           np.array([1, np.nan], np.float32).tobytes()]
    head = PushHeader(0, 1, 0, 1.0, NUMEL, segments=state.layout.signature, finite=finite)
    outcome = agg.push(head, bad)
    assert outcome.status == REFUSED
    assert re.search(r"NaN or inf in variable 'w'.*first 4 of 6 values were applied",
                     outcome.message)
    np.testing.assert_array_equal(state.params, [-1, -1, -1, -1, 0, 0])
    assert state.step == 0 and list(state.ledger) == [(0, 0, 1, 0)]
    again = agg.push(head, [np.ones(NUMEL, np.float32).tobytes()])  # its retry: same answer
    assert again.status == REFUSED and again.duplicate
    np.testing.assert_array_equal(state.params, [-1, -1, -1, -1, 0, 0])
    good = agg.push(replace(head, seq=2), [np.ones(NUMEL, np.float32).tobytes()])
    assert good.status == APPLIED and good.step == 1
    np.testing.assert_array_equal(state.params, [-2, -2, -2, -2, -1, -1])
