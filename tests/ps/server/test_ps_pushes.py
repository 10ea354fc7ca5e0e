"""Exactly-once pushes and the replica set: the (worker, incarnation, seq) table, in-process."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from towerflow.errors import InvalidArgumentError, ResourceExhaustedError
from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.server.pushes import INCARNATION_AHEAD_NS, PushTable
from towerflow.ps.wire.calls import APPLIED, MESSAGE_LIMIT, REFUSED
from towerflow.ps.wire.messages import PushHeader, PushOutcome

NUMEL = 4


def make(mode: str = "async", replicas: int = 2, **cfg):
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    state = ShardState(layout, np.zeros(NUMEL, np.float32), make_optimizer("sgd", NUMEL))
    return state, DenseShard(state, AggregationConfig(mode, total_num_replicas=replicas,
                                                           **cfg)).aggregator


def push(state, agg, worker: int, incarnation: int, seq: int, value: float = 1.0, *,
         token: int | None = None, chunks=None, **kw):
    head = PushHeader(worker, seq, state.step if token is None else token, 1.0, NUMEL,
                      incarnation=incarnation, segments=state.layout.signature, **kw)
    data = chunks if chunks is not None else [np.full(NUMEL, value, np.float32).tobytes()]
    return agg.push(head, data)


def test_a_late_retry_from_a_superseded_incarnation_is_refused_naming_both() -> None:
    state, agg = make()
    assert push(state, agg, 1, 100, 5).status == APPLIED
    assert push(state, agg, 1, 200, 1).status == APPLIED  # the worker restarted
    late = push(state, agg, 1, 100, 5)
    assert late.status == REFUSED and not late.duplicate
    assert "incarnation 100, superseded by incarnation 200" in late.message
    np.testing.assert_array_equal(state.params, -2.0)
    assert state.step == 2 and [e[:3] for e in state.ledger] == [(1, 100, 5), (1, 200, 1)]


def test_a_push_cancelled_before_its_payload_leaves_the_earlier_push_answered() -> None:
    state, agg = make()
    assert push(state, agg, 1, 300, 5).status == APPLIED

    def cancelled():
        raise ConnectionResetError("cancelled before the payload")
        yield b""  # pragma: no cover - a generator

    with pytest.raises(ConnectionResetError):
        push(state, agg, 1, 300, 6, chunks=cancelled())
    again = push(state, agg, 1, 300, 5)
    assert again.status == APPLIED and again.duplicate
    np.testing.assert_array_equal(state.params, -1.0)
    # the cancelled push itself was forgotten: its retry applies once
    assert push(state, agg, 1, 300, 6).status == APPLIED
    assert push(state, agg, 1, 300, 6).duplicate
    np.testing.assert_array_equal(state.params, -2.0)


def test_a_refused_newer_incarnation_does_not_reopen_the_older_ones_pushes() -> None:
    state, agg = make()
    assert push(state, agg, 1, 400, 5).status == APPLIED
    bad = PushHeader(1, 1, 0, 1.0, NUMEL, incarnation=401, segments=(("v", (4,)),))
    assert agg.push(bad, [np.ones(NUMEL, np.float32).tobytes()]).status == REFUSED
    retry = push(state, agg, 1, 400, 5)
    assert retry.status == APPLIED and retry.duplicate
    np.testing.assert_array_equal(state.params, -1.0)
    # a newer incarnation that is accepted supersedes the old one for good
    assert push(state, agg, 1, 401, 1).status == APPLIED
    assert "superseded by incarnation 401" in push(state, agg, 1, 400, 6).message


def test_a_retry_while_its_push_is_in_progress_waits_for_its_answer() -> None:
    state, agg = make()
    started, release = threading.Event(), threading.Event()

    def slow():
        yield np.ones(2, np.float32).tobytes()
        started.set()
        assert release.wait(10)
        yield np.ones(2, np.float32).tobytes()

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(push, state, agg, 0, 9, 1, chunks=slow())
        assert started.wait(10)
        retry = pool.submit(push, state, agg, 0, 9, 1)
        assert not retry.done()
        release.set()
        assert first.result(10).status == APPLIED
        assert retry.result(10).duplicate
    np.testing.assert_array_equal(state.params, -1.0)


def test_push_table_rows_restore_into_a_fresh_table() -> None:
    state, agg = make()
    push(state, agg, 0, 500, 5)
    push(state, agg, 1, 600, 2)
    rows = state.admission.push_rows()
    assert rows == [(0, 500, 5, "applied"), (1, 600, 2, "applied")]
    table = PushTable()
    table.merge(rows, step=2)
    table.merge([(0, 400, 9, "applied")], step=2)  # older facts lose
    head = PushHeader(0, 5, 0, 1.0, NUMEL, incarnation=500)
    assert table.lookup(head).kind == "done" and table.lookup(head).outcome.applied
    assert table.lookup(PushHeader(0, 6, 0, 1.0, NUMEL, incarnation=500)).kind == "new"
    assert table.lookup(PushHeader(0, 1, 0, 1.0, NUMEL, incarnation=400)).kind == "superseded"


@settings(max_examples=40, deadline=None)
@given(ahead=st.integers(INCARNATION_AHEAD_NS + 10**9, (1 << 64) - 1 - time.time_ns()))
def test_an_incarnation_ahead_of_the_clock_never_locks_the_replica_out(ahead: int) -> None:
    state, agg = make()
    forged = push(state, agg, 0, time.time_ns() + ahead, 1, value=100.0)
    assert forged.status == REFUSED and not forged.duplicate
    assert re.search(r"comes from incarnation \d+, more than 300 s ahead of this ps's clock",
                     forged.message)
    np.testing.assert_array_equal(state.params, 0.0)  # nothing applied, nothing remembered
    assert state.admission.push_rows() == []
    honest = push(state, agg, 0, time.time_ns(), 1)
    assert honest.status == APPLIED
    np.testing.assert_array_equal(state.params, -1.0)


def test_a_checkpointed_row_ahead_of_the_clock_is_dropped_on_restore() -> None:
    table = PushTable()
    table.merge([(0, (1 << 64) - 1, 9, "applied"), (1, 700, 3, "applied")], step=3)
    assert table.rows() == [(1, 700, 3, "applied")]
    restarted = PushHeader(0, 1, 0, 1.0, NUMEL, incarnation=time.time_ns())
    assert table.lookup(restarted).kind == "new"


def _with_optimizer(name: str, mode: str, **options):
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    state = ShardState(layout, np.ones(NUMEL, np.float32), make_optimizer(name, NUMEL, **options))
    return state, DenseShard(state, AggregationConfig(mode, total_num_replicas=1))


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize(("name", "options"), [("sgd", {}), ("momentum", {"momentum": 0.9}),
                                               ("adam", {}), ("adagrad", {})])
def test_an_update_that_would_overflow_is_refused_and_changes_nothing(mode, name, options):
    state, shard = _with_optimizer(name, mode, **options)
    head = PushHeader(0, 1, 0, 1e38, NUMEL, incarnation=1, segments=state.layout.signature)
    outcome, _ = shard.push(head, [np.full(NUMEL, 10.0, np.float32).tobytes()])
    assert outcome.status == ("refused" if mode == "async" else "voided")
    assert re.search(r"learning rate 1e\+38, largest gradient 10\) could take a parameter or "
                     r"optimizer slot of \w+ to [\d.e+]+, past 8\.51e\+37 .*nothing was applied",
                     outcome.message)
    np.testing.assert_array_equal(state.params, 1.0)
    assert all(np.isfinite(buf).all() for buf in state.optimizer.slots.values())
    # the same replica's next, sane push is applied
    sane = PushHeader(0, 2, state.step, 0.1, NUMEL, incarnation=1, segments=state.layout.signature)
    assert shard.push(sane, [np.full(NUMEL, 1.0, np.float32).tobytes()])[0].status == APPLIED


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["sgd", "momentum", "adam", "adagrad"]),
       lr=st.floats(1e-6, 3e38), grad=st.floats(-3e38, 3e38), streamed=st.booleans())
@example(name="adam", lr=3.402823567797336e+37, grad=0.0, streamed=False)  # lr / bias1 overflows
def test_no_finite_push_leaves_a_non_finite_parameter_or_slot(name, lr, grad, streamed):
    options = {"momentum": 0.9} if name == "momentum" else {}
    state, shard = _with_optimizer(name, "async", **options)
    for seq in (1, 2):
        head = PushHeader(0, seq, state.step, lr, NUMEL, incarnation=1,
                          segments=state.layout.signature)
        chunks = [np.full(NUMEL, grad, np.float32).tobytes()]
        if streamed:
            outcome, reply = shard.push(head, chunks, want_params=True)
            for _ in reply:
                pass
        else:
            outcome, _ = shard.push(head, chunks)
        assert outcome.status in ("applied", "refused")
        assert np.isfinite(state.params).all()
        assert all(np.isfinite(buf).all() for buf in state.optimizer.slots.values())


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_a_push_from_a_worker_outside_the_replica_set_is_refused(mode) -> None:
    state, agg = make(mode)
    for worker in (2, 7, -1):
        outcome = push(state, agg, worker, 1, 1)
        assert outcome.status == REFUSED
        assert f"from worker {worker} was refused: the replicas of this job are 0 .. 1" \
            in outcome.message
    assert state.step == 0 and len(state.admission.push_rows()) == 0
    np.testing.assert_array_equal(state.params, 0.0)


def test_done_from_ids_that_are_not_replicas_is_refused_and_the_step_still_needs_two() -> None:
    state, agg = make("sync", timeout=0.5)
    for worker in (5, 6):
        with pytest.raises(InvalidArgumentError, match=rf"Done from worker {worker} was refused"):
            agg.worker_done(worker)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(push, state, agg, 0, 1, 1, 2.0)
        assert first.exception(10) is not None  # deadline: one gradient is not a step
    assert state.step == 0
    np.testing.assert_array_equal(state.params, 0.0)


def test_ssp_a_stray_worker_id_never_becomes_the_slowest() -> None:
    state, agg = make("ssp", staleness=1, timeout=5)
    assert push(state, agg, 7, 1, 1).status == REFUSED
    for seq in range(1, 6):  # two real replicas take turns: never held by worker 7
        assert push(state, agg, 0, 1, seq).status == APPLIED
        assert push(state, agg, 1, 1, seq).status == APPLIED
    assert state.step == 10


def test_a_sync_step_counts_each_replica_once() -> None:
    """The retry of a push that timed out waiting joins its step; it is not summed again."""
    state, agg = make("sync", timeout=0.3)
    with pytest.raises(Exception, match=r"received 1 \(from worker 0\)"):
        push(state, agg, 0, 1, 1, 2.0)
    with ThreadPoolExecutor(2) as pool:
        again = pool.submit(push, state, agg, 0, 1, 2, 2.0)  # same step, a new push number
        retry = pool.submit(push, state, agg, 0, 1, 1, 2.0)  # the same push again
        other = push(state, agg, 1, 1, 1, 4.0)
        assert other.status == APPLIED and other.step == 1
        assert again.result(10).status == APPLIED and retry.result(10).duplicate
    np.testing.assert_allclose(state.params, -3.0)  # the mean of 2 and 4: each once
    assert state.step == 1 and state.stats.updates == 1


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_an_infinite_timeout_is_refused_and_none_waits_forever(mode) -> None:
    with pytest.raises(InvalidArgumentError, match=r"timeout must be a finite number of seconds "
                                                   r"> 0, got inf; use timeout=None to wait"):
        AggregationConfig(mode, total_num_replicas=2, timeout=float("inf"))
    for bad in (float("nan"), 0, -1.0, True, "5"):
        with pytest.raises(InvalidArgumentError, match=r"timeout must be"):
            AggregationConfig(mode, total_num_replicas=2, timeout=bad)
    state, agg = make(mode, timeout=None, **({"staleness": 0} if mode == "ssp" else {}))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(push, state, agg, 0, 1, 1)
        with pytest.raises(TimeoutError):
            first.result(timeout=0.5)  # still waiting, no crash
        assert push(state, agg, 1, 1, 1).status == APPLIED
        assert first.result(10).status == APPLIED


def test_refusal_messages_and_stats_stay_bounded() -> None:
    state, agg = make()
    huge = tuple((f"v{i}" * 50, (i, i)) for i in range(100_000))
    for seq in range(1, 4):
        head = PushHeader(0, seq, 0, 1.0, NUMEL, incarnation=1, segments=huge)
        outcome = agg.push(head, [])
        assert outcome.status == REFUSED and len(outcome.message) < MESSAGE_LIMIT + 100
    assert len(state.stats.refusals) == 3
    assert sum(map(len, state.stats.refusals)) < 4 * MESSAGE_LIMIT
    assert state.stats.refused == 3 and len(state.admission.push_rows()) == 0


def test_chunk_bytes_held_are_bounded_by_the_staging_limit() -> None:
    """A push holds one chunk at a time: chunks within the limit pass one after the other,
    a chunk past it ends the push before it is applied (its retry continues)."""
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    state = ShardState(layout, np.zeros(NUMEL, np.float32), make_optimizer("sgd", NUMEL),
                       staging_limit=8)
    agg = DenseShard(state, AggregationConfig(total_num_replicas=1)).aggregator
    with pytest.raises(ResourceExhaustedError, match=r"staging limit of 8 bytes"):
        push(state, agg, 0, 1, 1, chunks=[np.ones(NUMEL, np.float32).tobytes()])
    assert state.staged == 0 and state.step == 0 and state.ledger == []
    np.testing.assert_array_equal(state.params, 0.0)
    assert push(state, agg, 0, 1, 1, chunks=[np.ones(2, np.float32).tobytes()] * 2
                ).status == APPLIED
    assert state.staged == 0 and state.step == 1
    np.testing.assert_array_equal(state.params, -1.0)


def test_the_push_table_keeps_a_bounded_number_of_worker_ids() -> None:
    from towerflow.ps.server.pushes import MAX_REPLICAS_TRACKED

    table = PushTable()
    for worker in range(MAX_REPLICAS_TRACKED):
        head = PushHeader(worker, 1, 0, 1.0, NUMEL, incarnation=1)
        table.register(head)
        table.settle(head, PushOutcome(APPLIED, 1))
    stranger = table.lookup(PushHeader(MAX_REPLICAS_TRACKED, 1, 0, 1.0, NUMEL, incarnation=1))
    assert stranger.kind == "refused"
    assert "already keeps the pushes of 4096 worker ids, its bound" in stranger.message
    assert table.lookup(PushHeader(7, 2, 0, 1.0, NUMEL, incarnation=1)).kind == "new"
    table.merge([(MAX_REPLICAS_TRACKED + 5, 1, 1, "applied")], step=1)
    assert len(table) == MAX_REPLICAS_TRACKED
