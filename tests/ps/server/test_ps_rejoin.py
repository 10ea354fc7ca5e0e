"""A sync replica that dies mid-step and comes back as a new incarnation (threads, one shard)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest

from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.wire.calls import APPLIED
from towerflow.ps.wire.messages import PushHeader
from towerflow.testing import wait_until

NUMEL = 4


def _sync(timeout: float | None):
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    state = ShardState(layout, np.zeros(NUMEL, np.float32), make_optimizer("sgd", NUMEL))
    return state, DenseShard(state, AggregationConfig(mode="sync", total_num_replicas=2,
                                                           timeout=timeout)).aggregator


def _push(state: ShardState, agg, worker: int, incarnation: int, seq: int, value: float,
          token: int | None = None):
    head = PushHeader(worker, seq, state.step if token is None else token, 1.0, NUMEL,
                      incarnation=incarnation, segments=state.layout.signature)
    return agg.push(head, [np.full(NUMEL, value, np.float32).tobytes()])


def _background(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread (a push that is never answered cannot hang the test)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


@pytest.mark.parametrize("later_step", [False, True])
def test_a_new_incarnation_joins_the_sync_step_and_the_dead_one_is_answered(later_step: bool):
    # wait for ever: a waiter nobody answers would hold its ps handler thread for good
    state, agg = _sync(timeout=None)
    if later_step:  # step 0 applied; the old incarnation dies counted in step 1
        first = _background(_push, state, agg, 1, 100, 1, 1.0)
        assert _push(state, agg, 0, 7, 1, 1.0).status == APPLIED
        assert first.result(timeout=10).status == APPLIED
    seq0 = state.step + 1
    dead = _background(_push, state, agg, 1, 100, seq0 + (0 if not later_step else 1), 2.0)
    wait_until(lambda: agg.counted == 1, timeout=10, what="the old incarnation counted")
    # worker 1 restarts: its new incarnation pulls the same step and pushes seq 1
    new = _background(_push, state, agg, 1, 200, 1, 8.0)
    wait_until(lambda: len(agg._waiting) == 2, timeout=10, what="the new push waiting")
    assert agg.counted == 1 and not new.done()  # a replica counts once per step
    step = state.step
    chief = _push(state, agg, 0, 7, seq0 + (1 if later_step else 0), 4.0)
    assert chief.status == APPLIED and chief.step == step + 1
    assert new.result(timeout=10).status == APPLIED
    # the dead incarnation's push is answered too: its gradient is in the step
    assert dead.result(timeout=10).status == APPLIED
    # steps: (1 + 1) / 2 when later_step, then (2 + 4) / 2; lr 1
    np.testing.assert_allclose(state.params, -(3.0 + (1.0 if later_step else 0.0)))
    # the new incarnation goes on at the next step with seq 2
    nxt = _background(_push, state, agg, 1, 200, 2, 0.0)
    assert _push(state, agg, 0, 7, 10, 0.0).status == APPLIED
    assert nxt.result(timeout=10).status == APPLIED
