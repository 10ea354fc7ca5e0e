"""A replicated job for the ps replica fault tests: two ps task processes with
``replicas=1`` (a dense shard and a table shard each), two workers' dense and table
clients, and pushers whose every acknowledged push is counted."""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.testing import LocalCluster, loopback_cluster

PLAN = plan_placement({"a": (256,), "b": (256,)}, 2)
TABLE = TableConfig("t", ModPartitioner(2, num_rows=20), 3, {"name": "sgd", "hyper": {}},
                    {"kind": "constant", "value": 0.0})
IDS = torch.arange(20)
WORKERS, PUSHES = 2, 40
AGGREGATION = AggregationConfig(total_num_replicas=WORKERS, replicas=1)


@contextlib.contextmanager
def replicated_job(env: dict[str, str], table: TableConfig = TABLE, push_wait: float = 30.0
                   ) -> Iterator[tuple[Any, list[PSClient], list[TableClient], Any]]:
    """Two ps task processes initialised with ``replicas=1`` (sgd, zeros: a dense shard and a
    table shard each) and two workers' dense and table clients with ``replicas=1`` -> (ps
    tasks, dense clients, table clients, (cluster, credentials))."""
    spec = loopback_cluster(2, WORKERS)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"], env=env) as lc:
        ps = [lc.start("ps", i) for i in range(2)]
        for i, task in enumerate(ps):
            task.wait_for_line(rf"ps task {i} serving at", timeout=60)
        with contextlib.ExitStack() as stack:
            workers = [stack.enter_context(PSClient(
                spec, PLAN, worker_id=w, credentials=lc.credentials, timeout=10.0,
                push_timeout=2.0, push_wait=push_wait, replicas=1)) for w in range(WORKERS)]
            tables = [TableClient(spec.job_tasks("ps"), credentials=lc.credentials,
                                  worker_id=w, timeout=2.0, retries=20,
                                  aggregation=AGGREGATION) for w in range(WORKERS)]
            for client in tables:
                stack.callback(client._close)
            tables[0].init_table(table)
            workers[0].initialize([np.zeros(s.numel, np.float32) for s in PLAN.shards],
                                  optimizer=pb.OptimizerSpec(name="sgd"),
                                  aggregation=AGGREGATION)
            yield ps, workers, tables, (spec, lc.credentials)


class Pushers:
    """Each worker pushes a gradient of ones ``pushes`` times in its own thread (to the
    dense shards, to every row of the table, or both: ``what``; None: until :meth:`stop`);
    the time of every acknowledged push is kept."""

    def __init__(self, workers: list[PSClient], tables: list[TableClient],
                 what: str = "dense", pushes: int | None = PUSHES,
                 table: TableConfig = TABLE) -> None:
        self.what, self.pushes, self.table = what, pushes, table
        self.acked: list[float] = []
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(w, t), daemon=True)
                         for w, t in zip(workers, tables, strict=True)]

    def _run(self, worker: PSClient, table: TableClient) -> None:
        params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
        grads = [np.ones(s.numel, np.float32) for s in PLAN.shards]
        try:
            for step in itertools.count(1):
                if self._stop.is_set() or self.pushes is not None and step > self.pushes:
                    break
                if self.what in ("dense", "both"):
                    result = worker.push(grads, lr=1.0, pull_into=params)
                    assert result.applied, result.messages
                if self.what in ("tables", "both"):
                    replies = table.push(self.table, IDS, torch.ones(len(IDS), 3), lr=1.0,
                                         step=step)
                    assert all(r.status == "applied" for r in replies), replies
                with self._lock:
                    self.acked.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failures.append(exc)

    def stop(self) -> None:
        """Each worker ends after the push it is making (``pushes`` None)."""
        self._stop.set()

    def __enter__(self) -> Pushers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None or self.pushes is None:
            self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a pusher did not end"


def check_exactly_once(workers: list[PSClient], tables: list[TableClient],
                       what: str = "dense", pushed: int = WORKERS * PUSHES,
                       table: TableConfig = TABLE) -> None:
    """Every shard holds -(every acknowledged push, ``pushed`` of them): sgd, lr 1,
    gradient 1, each push once."""
    params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
    workers[0].pull(params)
    for values in params:
        np.testing.assert_array_equal(values, np.full(values.size, -pushed if what in (
            "dense", "both") else 0.0, np.float32))
    rows = tables[0].pull(table, IDS)
    assert torch.equal(rows, torch.full((len(IDS), 3), -float(pushed) if what in (
        "tables", "both") else 0.0))
