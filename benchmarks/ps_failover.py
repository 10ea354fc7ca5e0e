"""Failover time of a replicated ps shard: kill -9 of a ps task to the next completed step.

Two ps tasks (``towerflow server`` processes) hold a dense shard and a table shard each,
with ``replicas=1``; two workers (threads of this process, each its own dense and table
client sharing one route per shard, as ``ParameterServer`` makes them) push the dense gradient and every row of the table in each step. After some steps
ps task 0 is killed with SIGKILL; the workers' clients switch shard 0 to its replica on ps
task 1 (a probe of ``grace`` seconds, then ``Promote``) and ask ps task 1 to go on without
its own replica (it was on ps task 0). Printed, per kill: seconds from the kill to the next
step each worker completed, and the slowest of them; then their median over the kills; and
the exactly-once check (every shard and row holds minus the steps acknowledged).

With ``--rejoin``, ps task 0 is then started again: it rejoins as the copy of both
shards (ps task 1 streams them to it in parts while the workers go on) and the time from
its start to both copies being live again is printed, with the workers' steps per second
during that catch-up against those before the kill; then ps task 1 is killed too, and the
time to every worker's next step (now on the replacement) printed as well. ``--rows``
sizes the table (the workers push its first 1,000 rows).

Commands::

    python benchmarks/ps_failover.py                  # 3 kills, ~30 s on 2 cores
    python benchmarks/ps_failover.py --kills 5 --grace 0.5
    python benchmarks/ps_failover.py --kills 3 --rejoin --rows 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.worker.tables.client import TableClient
from towerflow.testing import LocalCluster, loopback_cluster, wait_until

PLAN = plan_placement({"a": (4096,), "b": (4096,)}, 2)
IDS = torch.arange(1000)
WORKERS = 2
_LIVE = r"shard {} has a live copy on ps task 0 again"


def _table(rows: int) -> TableConfig:
    return TableConfig("t", ModPartitioner(2, num_rows=rows), 16, {"name": "sgd", "hyper": {}},
                       {"kind": "constant", "value": 0.0})


def _rate(done: list[list[float]], start: float, stop: float) -> float:
    """The workers' steps per second completed in ``[start, stop]``."""
    return sum(start <= t <= stop for d in done for t in d) / max(stop - start, 1e-9)


def _next_step(done: list[list[float]], errors: list, since: float) -> float:
    """Seconds from ``since`` to the step every worker completed after it (the slowest)."""
    wait_until(lambda: errors or all(d and d[-1] > since for d in done), timeout=60,
               what=f"a step of every worker {time.monotonic() - since:.0f} s after the kill")
    if errors:
        raise errors[0]
    return max(next(t for t in d if t > since) for d in done) - since


def one_kill(env: dict[str, str], grace: float, before: int, rows: int = 1000,
             rejoin: bool = False) -> tuple[float, list[float]]:
    """Run until ``before`` steps, kill ps task 0, run until every worker completed a step
    after it; ``(slowest, per worker)`` seconds from the kill to each worker's next
    completed step (with ``rejoin``, then the replacement's catch-up and a second kill)."""
    spec = loopback_cluster(2, WORKERS)
    table = _table(rows)
    aggregation = AggregationConfig(total_num_replicas=WORKERS, replicas=1)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"], env=env) as lc, \
            contextlib.ExitStack() as stack:
        ps = [lc.start("ps", i) for i in range(2)]
        for i, task in enumerate(ps):
            task.wait_for_line(rf"ps task {i} serving at", timeout=60)
        dense = [stack.enter_context(PSClient(
            spec, PLAN, worker_id=w, credentials=lc.credentials, timeout=10.0,
            push_timeout=2.0, push_wait=30.0, replicas=1)) for w in range(WORKERS)]
        tables = [TableClient(spec.job_tasks("ps"), credentials=lc.credentials, worker_id=w,
                              timeout=2.0, retries=20, aggregation=aggregation)
                  for w in range(WORKERS)]
        for client, worker in zip(tables, dense, strict=True):
            stack.callback(client._close)
            client.share_routes([shard.route for shard in worker.shards])  # as the strategy
        for route in [s.route for c in dense for s in c.shards]:
            route.grace = grace
        tables[0].init_table(table)
        dense[0].initialize([np.zeros(s.numel, np.float32) for s in PLAN.shards],
                            optimizer=pb.OptimizerSpec(name="sgd"), aggregation=aggregation)
        done: list[list[float]] = [[] for _ in range(WORKERS)]
        stop = threading.Event()
        errors: list[BaseException] = []

        def steps(w: int) -> None:
            params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
            grads = [np.ones(s.numel, np.float32) for s in PLAN.shards]
            step = 0
            try:
                while not stop.is_set():
                    step += 1
                    assert dense[w].push(grads, lr=1.0, pull_into=params).applied
                    tables[w].push(table, IDS, torch.ones(len(IDS), 16), lr=1.0, step=step)
                    done[w].append(time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - printed below
                errors.append(exc)

        threads = [threading.Thread(target=steps, args=(w,)) for w in range(WORKERS)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: min(map(len, done)) >= before, timeout=120, what="steps")
            killed = time.monotonic()
            ps[0].kill()
            _next_step(done, errors, killed)
            if rejoin:
                _rejoin(ps, done, errors, killed)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
        if errors:
            raise errors[0]
        per = [next(t for t in d if t > killed) - killed for d in done]
        acked = sum(map(len, done))
        params = [np.empty(s.numel, np.float32) for s in PLAN.shards]
        dense[0].pull(params)
        rows = tables[0].pull(table, IDS)
        exact = all(np.all(p == -acked) for p in params) and bool(torch.all(rows == -acked))
        print(f"  {acked} steps acknowledged; every shard and row holds each once: {exact}")
        return max(per), per


def _rejoin(ps: list, done: list[list[float]], errors: list, killed: float) -> None:
    """Start ps task 0 again; print its catch-up time and the steps per second meanwhile;
    kill ps task 1 and print the time to every worker's next step."""
    live = [_LIVE.format(0), _LIVE.format(1)]
    seen = [len(ps[1].find(pattern)) for pattern in live]
    started = time.monotonic()
    ps[0].start()
    for pattern, count in zip(live, seen, strict=True):
        ps[1].wait_for_line(pattern, timeout=300, count=count + 1)
    caught = time.monotonic()
    before = _rate(done, min(d[0] for d in done), killed)
    print(f"  rejoin: ps task 0 started again was the live copy of both shards "
          f"{caught - started:.2f} s later; the workers made {_rate(done, started, caught):.0f} "
          f"steps/s meanwhile (with both copies, before the kill: {before:.0f})")
    second = time.monotonic()
    ps[1].kill()
    after = _next_step(done, errors, second)
    print(f"  then kill -9 of ps task 1: every worker's next step {after:.2f} s later, both "
          "shards on the replacement")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--grace", type=float, default=1.0,
                        help="seconds a primary must answer no Status before it is given up")
    parser.add_argument("--before", type=int, default=20, help="steps of each worker first")
    parser.add_argument("--rows", type=int, default=1000, help="rows of the table (default 1000)")
    parser.add_argument("--rejoin", action="store_true",
                        help="start ps task 0 again after the failover, then kill ps task 1")
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    firsts = []
    for kill in range(args.kills):
        first, per = one_kill(env, args.grace, args.before, args.rows, args.rejoin)
        firsts.append(first)
        print(f"kill {kill + 1}: every worker completed a step {first:.2f} s after the kill "
              f"(each worker's next step: {', '.join(f'{p:.2f}' for p in per)} s)")
    print(f"failover (kill -9 -> every worker's next completed step), grace {args.grace:g} s: "
          "median "
          f"{statistics.median(firsts):.2f} s, max {max(firsts):.2f} s over {args.kills} kills "
          f"(target <= 5 s)")


if __name__ == "__main__":
    main()
