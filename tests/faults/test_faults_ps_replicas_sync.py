"""A primary ps task killed (kill -9) mid-run with ``replicas=1`` in sync and ssp mode, real ps
processes on loopback, two workers: in sync mode the run ends with the same parameters, bit
for bit, as the same run without the fault (its reference: the same ps tasks served from this
process, nothing killed); in ssp mode it ends with every acknowledged push, dense and rows, in
the parameters exactly once."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from towerflow.cluster.transport import Credentials
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.testing import LocalCluster, loopback_cluster, wait_until
from towerflow.testing.inprocess import ps_tasks

PLAN = plan_placement({"a": (256,), "b": (256,)}, 2)
TABLE = TableConfig("t", ModPartitioner(2, num_rows=20), 3, {"name": "sgd", "hyper": {}},
                    {"kind": "constant", "value": 0.0})
IDS = torch.arange(20)
WORKERS, STEPS, KILL_AFTER = 2, 16, 6
SYNC = AggregationConfig(mode="sync", total_num_replicas=WORKERS, replicas=1)
SSP = AggregationConfig(mode="ssp", total_num_replicas=WORKERS, staleness=1, replicas=1)


def initial() -> list[np.ndarray]:
    return [np.linspace(-1, 1, s.numel, dtype=np.float32) * (i + 1)
            for i, s in enumerate(PLAN.shards)]


def gradients(params: list[np.ndarray], worker: int, step: int) -> list[np.ndarray]:
    """Worker ``worker``'s gradient of ``step``: a function of the parameters it was sent."""
    return [np.sin(p * np.float32(worker + 1.5) + np.float32(step)).astype(np.float32)
            for p in params]


@contextlib.contextmanager
def ps_processes(env: dict[str, str]) -> Iterator[tuple[Any, Credentials, list[Any]]]:
    """Two ps task processes -> (cluster, credentials, ps tasks)."""
    spec = loopback_cluster(2, WORKERS)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"], env=env) as lc:
        ps = [lc.start("ps", i) for i in range(2)]
        for i, task in enumerate(ps):
            task.wait_for_line(rf"ps task {i} serving at", timeout=60)
        yield spec, lc.credentials, ps


@contextlib.contextmanager
def workers_of(spec: Any, credentials: Credentials, aggregation: AggregationConfig,
               optimizer: str, start: list[np.ndarray]
               ) -> Iterator[tuple[list[PSClient], list[TableClient]]]:
    """The two workers' dense and table clients (``replicas=1``); worker 0 initialises the
    dense shards with ``start`` and the table (zeros)."""
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(PSClient(
            spec, PLAN, worker_id=w, credentials=credentials, timeout=10.0, push_timeout=2.0,
            push_wait=30.0, replicas=1, sync=aggregation.mode == "sync"))
            for w in range(WORKERS)]
        tables = [TableClient(spec.job_tasks("ps"), credentials=credentials, worker_id=w,
                              timeout=2.0, retries=20, aggregation=aggregation)
                  for w in range(WORKERS)]
        for client in tables:
            stack.callback(client._close)
        tables[0].init_table(TABLE)
        workers[0].initialize(start, optimizer=pb.OptimizerSpec(name=optimizer),
                              aggregation=aggregation)
        yield workers, tables


def run_sync(workers: list[PSClient], tables: list[TableClient],
             at_step: Callable[[int], None] = lambda n: None
             ) -> tuple[list[np.ndarray], torch.Tensor]:
    """Each worker trains ``STEPS`` sync steps in its own thread (its gradients, dense and
    rows, a function of the parameters and rows each step sent back); ``at_step(n)`` runs
    once ``n`` steps were acknowledged to both. Returns the parameters and rows after it."""
    done = [0] * WORKERS
    failures: list[BaseException] = []

    def train(w: int) -> None:
        params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
        try:
            workers[w].pull(params)
            for step in range(STEPS):
                rows = tables[w].pull(TABLE, IDS)
                result = workers[w].push(gradients(params, w, step), lr=0.05, pull_into=params)
                assert result.applied, result.messages
                grads = torch.from_numpy(gradients([rows.numpy()], w, step)[0])
                replies = tables[w].push(TABLE, IDS, grads, lr=0.5, step=step + 1)
                assert all(r.status == "applied" for r in replies), replies
                done[w] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=train, args=(w,), daemon=True) for w in range(WORKERS)]
    for thread in threads:
        thread.start()
    wait_until(lambda: failures or min(done) >= KILL_AFTER, timeout=60,
               what=f"{KILL_AFTER} steps acknowledged")
    at_step(min(done))
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker did not end"
    assert not failures, failures
    params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
    assert workers[0].pull(params) == STEPS
    assert [int(s.status().step) for s in workers[0].shards] == [STEPS] * 2
    return params, tables[0].pull(TABLE, IDS)


@pytest.mark.slow
def test_kill_9_in_sync_mode_ends_with_the_parameters_of_the_run_without_it(subprocess_env):
    secret = Credentials(secret=b"sync-reference")
    with ps_tasks(secret, num_ps=2, num_workers=WORKERS) as spec, \
            workers_of(spec, secret, SYNC, "adam", initial()) as (workers, tables):
        reference, reference_rows = run_sync(workers, tables)
    with ps_processes(subprocess_env) as (spec, credentials, ps), \
            workers_of(spec, credentials, SYNC, "adam", initial()) as (workers, tables):
        params, rows = run_sync(workers, tables, lambda n: ps[0].kill())  # SIGKILL, mid-run
        assert {w.shards[0].route.where() for w in workers} == {(1, 2)}  # on the copy
        assert {t._routing.where(0) for t in tables} == {(1, 2)}
    for after, before in zip(params, reference, strict=True):
        np.testing.assert_array_equal(after, before)  # bit for bit
    assert torch.equal(rows, reference_rows)
    assert not np.array_equal(reference[0], initial()[0]) and reference_rows.abs().sum() > 0


@pytest.mark.slow
def test_kill_9_in_ssp_mode_keeps_every_acknowledged_push_once(subprocess_env):
    zeros = [np.zeros(s.numel, np.float32) for s in PLAN.shards]
    acked: list[float] = []
    failures: list[BaseException] = []
    with ps_processes(subprocess_env) as (spec, credentials, ps), \
            workers_of(spec, credentials, SSP, "sgd", zeros) as (workers, tables):

        def train(w: int) -> None:
            grads = [np.ones(s.numel, np.float32) for s in PLAN.shards]
            try:
                for step in range(1, STEPS + 1):
                    assert workers[w].push(grads, lr=1.0).applied
                    replies = tables[w].push(TABLE, IDS, torch.ones(len(IDS), 3), lr=1.0,
                                             step=step)
                    assert all(r.status == "applied" for r in replies), replies
                    acked.append(time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)

        threads = [threading.Thread(target=train, args=(w,), daemon=True)
                   for w in range(WORKERS)]
        for thread in threads:
            thread.start()
        wait_until(lambda: failures or len(acked) >= 2 * KILL_AFTER, timeout=60,
                   what="pushes acknowledged")
        ps[0].kill()  # SIGKILL, pushes in flight
        for thread in threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a worker did not end"
        assert not failures, failures
        assert len(acked) == WORKERS * STEPS
        params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
        workers[0].pull(params)
        for values in params:  # sgd, lr 1, gradient 1: each acknowledged push once
            np.testing.assert_array_equal(values, np.full(values.size, -WORKERS * STEPS,
                                                          np.float32))
        assert torch.equal(tables[0].pull(TABLE, IDS),
                           torch.full((len(IDS), 3), -float(WORKERS * STEPS)))
        assert workers[0].shards[0].route.where() == (1, 2)
        assert int(workers[0].shards[0].status().step) == WORKERS * STEPS
