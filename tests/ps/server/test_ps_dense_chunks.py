"""A dense push is applied (async) or summed (sync) chunk by chunk as it arrives.

Nothing is held per worker at full size: retries continue after what was
applied, a bad chunk ends a push (async) or voids its step (sync), a backup's
late gradient is never summed into the next step, and a real ps process
under four pushing workers grows by far less than one copy of its
parameters per worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.wire.calls import APPLIED, REFUSED, STALE, VOIDED
from towerflow.ps.wire.messages import PushHeader
from towerflow.testing import wait_until

NUMEL = 50
CHUNK = 10  # five chunks of ten elements


def make(mode: str = "async", optimizer: str = "sgd", **cfg):
    layout = plan_placement({"w": (NUMEL,)}, 1).shards[0]
    state = ShardState(layout, np.zeros(NUMEL, np.float32), make_optimizer(optimizer, NUMEL))
    cfg.setdefault("total_num_replicas", 1)
    return state, DenseShard(state, AggregationConfig(mode=mode, **cfg)).aggregator


def header(state: ShardState, worker: int = 0, seq: int = 1, token: int | None = None
           ) -> PushHeader:
    return PushHeader(worker, seq, state.step if token is None else token, 1.0, NUMEL,
                      incarnation=5, segments=state.layout.signature)


def pieces(grad: np.ndarray, cut_after: int | None = None, sent: list | None = None):
    """``grad`` in chunks of CHUNK elements; the stream breaks after ``cut_after`` chunks."""
    for index, start in enumerate(range(0, NUMEL, CHUNK)):
        if index == cut_after:
            raise ConnectionResetError("the stream was cut off")
        if sent is not None:
            sent.append(index)
        yield grad[start:start + CHUNK].tobytes()


def distinct(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(1, 2, NUMEL).astype(np.float32)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_async_a_push_cut_off_then_retried_whole_applies_every_element_once(optimizer):
    state, agg = make(optimizer=optimizer)
    reference, _ = make(optimizer=optimizer)
    grad = distinct(1)
    reference.apply(grad, 1.0)
    for cut in (2, 4):  # cut off after 2 chunks, its retry after 4, the next retry whole
        with pytest.raises(ConnectionResetError):
            agg.push(header(state), pieces(grad, cut_after=cut))
        assert state.step == 0 and state.staged == 0 and state.optimizer.step == 1
    outcome = agg.push(header(state), pieces(grad))
    assert outcome.status == APPLIED and outcome.step == 1 and not outcome.duplicate
    np.testing.assert_array_equal(state.params, reference.params)  # each element once
    assert state.optimizer.step == 1  # one update, numbered once across its attempts
    again = agg.push(header(state), pieces(grad))
    assert again.duplicate and again.status == APPLIED
    np.testing.assert_array_equal(state.params, reference.params)
    assert state.ledger == [(0, 5, 1, 1)]


def test_async_nan_in_chunk_3_of_5_applies_chunks_1_and_2_only():
    state, agg = make()
    grad = distinct(2)
    grad[2 * CHUNK + 3] = np.nan
    sent: list[int] = []
    outcome = agg.push(header(state), pieces(grad, sent=sent))
    assert outcome.status == REFUSED
    assert sent == [0, 1, 2]  # the push ended at the bad chunk: nothing more was read
    np.testing.assert_array_equal(state.params[:2 * CHUNK], -grad[:2 * CHUNK])
    np.testing.assert_array_equal(state.params[2 * CHUNK:], 0.0)
    assert np.isfinite(state.params).all()
    assert (f"contains NaN or inf in variable 'w' (shape [{NUMEL}]), at element 23 of the shard; "
            f"its first 20 of {NUMEL} values were applied before the chunk that holds it, the "
            "rest was refused") in outcome.message
    assert state.step == 0 and state.stats.refused == 1 and state.stats.refusals == [
        outcome.message]
    retry = agg.push(header(state), pieces(distinct(3)))  # the same push again: same answer
    assert retry.status == REFUSED and retry.duplicate
    np.testing.assert_array_equal(state.params[2 * CHUNK:], 0.0)


def test_async_a_chunk_past_the_magnitude_bound_ends_the_push_with_a_clear_message():
    state, agg = make()
    grad = np.ones(NUMEL, np.float32)
    grad[4 * CHUNK] = 3e38  # finite, but the update would leave float32's range
    outcome = agg.push(header(state), pieces(grad))
    assert outcome.status == REFUSED
    assert "could take a parameter" in outcome.message
    assert f"its first 40 of {NUMEL} values were applied before that chunk" in outcome.message
    np.testing.assert_array_equal(state.params[:40], -1.0)
    np.testing.assert_array_equal(state.params[40:], 0.0)


def test_sync_three_workers_one_backup_count_each_gradient_once():
    """total_num_replicas=3, replicas_to_aggregate=2: the two first admitted are averaged;
    the third, arriving while they are summed, waits and is stale: none of it is summed,
    in that step or the next."""
    state, agg = make("sync", total_num_replicas=3, replicas_to_aggregate=2)
    grads = {w: distinct(10 + w) for w in range(3)}
    gate = threading.Event()
    first_chunk = [threading.Event(), threading.Event()]
    read_of_late: list[int] = []

    def held(worker: int):
        for index, chunk in enumerate(pieces(grads[worker])):
            yield chunk
            if index == 0:
                first_chunk[worker].set()
                assert gate.wait(10)

    with ThreadPoolExecutor(3) as pool:
        fast = [pool.submit(agg.push, header(state, w), held(w)) for w in (0, 1)]
        assert all(e.wait(10) for e in first_chunk)  # both admitted and summing
        late = pool.submit(agg.push, header(state, 2), pieces(grads[2], sent=read_of_late))
        wait_until(lambda: state.stats.pushes == 3,
                   timeout=10.0, what="the late push begun")
        gate.set()
        assert [f.result(timeout=10).status for f in fast] == [APPLIED, APPLIED]
        assert late.result(timeout=10).status == STALE
    assert read_of_late == [] and state.step == 1 and state.stats.stale == 1
    step1 = -(grads[0] + grads[1]) / 2
    np.testing.assert_allclose(state.params, step1, rtol=1e-6)
    # the next step: the late worker's fresh gradient and worker 0's; nothing stale in it
    new = {0: distinct(20), 2: distinct(22)}
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(agg.push, header(state, w, seq=2), pieces(new[w])) for w in (0, 2)]
        assert [f.result(timeout=10).status for f in done] == [APPLIED, APPLIED]
    np.testing.assert_allclose(state.params, step1 - (new[0] + new[2]) / 2, rtol=1e-6)
    assert state.step == 2


def test_sync_a_cut_off_push_is_continued_by_its_retry_and_counted_once():
    state, agg = make("sync", total_num_replicas=2)
    g0, g1 = distinct(30), distinct(31)
    with pytest.raises(ConnectionResetError):
        agg.push(header(state, 0), pieces(g0, cut_after=3))
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(agg.push, header(state, 1), pieces(g1))
        retry = agg.push(header(state, 0), pieces(g0))  # its stream again, from the start
        assert retry.status == APPLIED and other.result(timeout=10).status == APPLIED
    np.testing.assert_allclose(state.params, -(g0 + g1) / 2, rtol=1e-6)
    assert state.step == 1


def test_sync_a_nan_chunk_voids_the_step_resets_the_sum_and_the_next_step_is_exact():
    state, agg = make("sync", total_num_replicas=2)
    g0, bad = distinct(40), distinct(41)
    bad[3 * CHUNK + 1] = np.inf
    gate, summing = threading.Event(), threading.Event()

    def held():  # worker 0's push, paused half way while worker 1's bad push arrives
        for index, chunk in enumerate(pieces(g0)):
            yield chunk
            if index == 2:
                summing.set()
                assert gate.wait(10)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(agg.push, header(state, 0), held())
        assert summing.wait(10)
        voided = agg.push(header(state, 1), pieces(bad))
        gate.set()
        assert first.result(timeout=10).status == VOIDED
    assert voided.status == VOIDED
    assert ("voided: the gradient pushed by worker 1 contains NaN or inf at element 31 in "
            "variable 'w'") in voided.message
    assert state.step == 0 and state.stats.voided == 2
    np.testing.assert_array_equal(state.params, 0.0)
    g0b, g1b = distinct(42), distinct(43)  # both compute the step again
    with ThreadPoolExecutor(1) as pool:
        again = pool.submit(agg.push, header(state, 0, seq=2), pieces(g0b))
        assert agg.push(header(state, 1, seq=2), pieces(g1b)).status == APPLIED
        assert again.result(timeout=10).status == APPLIED
    np.testing.assert_allclose(state.params, -(g0b + g1b) / 2, rtol=1e-6)  # the sum was reset


# -- memory of a real ps process ---------------------------------------------------------

MB = 1 << 20
PARAM_MB = 24
WORKERS = 4


def _status_bytes(pid: int, field: str) -> int:
    """A memory figure of ``/proc/<pid>/status`` (``VmHWM``, ``VmRSS``) in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _reset_hwm(pid: int) -> bool:
    """Reset the peak RSS count of ``pid`` (``echo 5 > clear_refs``); False where refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ps_memory_under_four_pushing_workers_holds_no_copy_per_worker(free_ports,
                                                                        subprocess_env):
    """A 24 MiB shard, 4 workers pushing and pulling it 3 times each, all at once.

    A ps holding every push in flight whole would grow by up to 4 x 24 = 96 MiB
    (one payload per worker). Applied chunk by chunk it holds parameters plus
    chunk buffers (1 MiB each, one per push in flight), gRPC's own buffers and
    the reply chunks: the growth of its peak RSS over its RSS right after the
    Init must stay under 1.5 x 24 = 36 MiB, which two held copies would already pass.
    """
    from towerflow.cluster import ClusterSpec
    from towerflow.ps import PSClient
    from towerflow.ps.wire import ps_pb2 as pb

    ports = free_ports(1 + WORKERS)
    spec = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
    env = dict(subprocess_env, TF_CONFIG=json.dumps({"cluster": spec,
                                                     "task": {"type": "ps", "index": 0}}))
    for key in ("TOWERFLOW_SECRET", "TOWERFLOW_SECRET_FILE"):
        env.pop(key, None)
    ps = subprocess.Popen([sys.executable, "-m", "towerflow", "server", "--serve-forever"],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    numel = PARAM_MB * MB // 4
    plan = plan_placement({"w": (numel,)}, 1)
    cluster = ClusterSpec(spec)
    clients: list[PSClient] = []
    try:
        clients = [PSClient(cluster, plan, worker_id=w, timeout=60.0) for w in range(WORKERS)]
        clients[0].shards[0]._retrying(clients[0].shards[0].status, 60.0)
        clients[0].initialize([np.zeros(numel, np.float32)],
                              optimizer=pb.OptimizerSpec(name="sgd"),
                              aggregation=AggregationConfig("async",
                                                            total_num_replicas=WORKERS))
        grads = [np.full(numel, 1e-3, np.float32)]
        pulled = {w: [np.empty(numel, np.float32)] for w in range(WORKERS)}
        clients[0].push(grads, lr=0.1, pull_into=pulled[0])  # warm: every page touched once
        after_init = _status_bytes(ps.pid, "VmRSS") if _reset_hwm(ps.pid) else _status_bytes(ps.pid, "VmHWM")
        start = threading.Barrier(WORKERS)

        def work(worker: int) -> None:
            start.wait(30)
            for _ in range(3):
                assert clients[worker].push(grads, lr=0.1, pull_into=pulled[worker]).applied

        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(work, range(WORKERS)))
        growth = _status_bytes(ps.pid, "VmHWM") - after_init
        print(f"ps peak RSS growth {growth / MB:.1f} MiB over {PARAM_MB} MiB of parameters")
        params = PARAM_MB * MB
        assert clients[0].pull(pulled[0]) == 1 + 3 * WORKERS
        np.testing.assert_allclose(pulled[0], -0.1 * 1e-3 * (1 + 3 * WORKERS), rtol=1e-4)
        assert growth < 1.5 * params, (
            f"ps peak RSS grew by {growth / MB:.1f} MiB over {PARAM_MB} MiB of parameters")
    finally:
        for c in clients:
            c.close(done=False)
        ps.terminate()
        try:
            ps.wait(10)
        except subprocess.TimeoutExpired:
            ps.kill()
            ps.wait(10)


def test_a_push_cut_off_part_way_by_a_worker_that_restarts_is_in_the_ledger_as_partial():
    state, agg = make()
    grad = distinct(50)
    with pytest.raises(ConnectionResetError):
        agg.push(header(state), pieces(grad, cut_after=2))  # incarnation 5 dies part way
    restarted = PushHeader(0, 1, state.step, 1.0, NUMEL, incarnation=6,
                           segments=state.layout.signature)
    assert agg.push(restarted, pieces(grad)).status == APPLIED
    assert state.admission.ledger_since(0)[1] == [(0, 5, 1, 0, True, 0, 2 * CHUNK),
                                        (0, 6, 1, 1, False, 0, NUMEL)]
    np.testing.assert_allclose(state.params[:2 * CHUNK], -2 * grad[:2 * CHUNK])
    np.testing.assert_allclose(state.params[2 * CHUNK:], -grad[2 * CHUNK:])
