"""Failover time of a replicated ps shard: kill -9 of a ps task to the next completed step.

Two ps tasks (``towerflow server`` processes) hold a dense shard and a table shard each,
with ``replicas=1``; two workers (threads of this process, each its own dense and table
client sharing one route per shard, as ``ParameterServer`` makes them) push the dense gradient and every row of the table in each step. After some steps
ps task 0 is killed with SIGKILL; the workers' clients switch shard 0 to its replica on ps
task 1 (a probe of ``grace`` seconds, then ``Promote``) and ask ps task 1 to go on without
its own replica (it was on ps task 0). Printed, per kill: seconds from the kill to the next
step each worker completed, and the slowest of them; then their median over the kills; and
the exactly-once check (every shard and row holds minus the steps acknowledged).

Commands::

    python benchmarks/ps_failover.py                  # 3 kills, ~30 s on 2 cores
    python benchmarks/ps_failover.py --kills 5 --grace 0.5
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
TABLE = TableConfig("t", ModPartitioner(2, num_rows=1000), 16, {"name": "sgd", "hyper": {}},
                    {"kind": "constant", "value": 0.0})
IDS = torch.arange(1000)
WORKERS = 2


def one_kill(env: dict[str, str], grace: float, before: int) -> tuple[float, list[float]]:
    """Run until ``before`` steps, kill ps task 0, run until every worker completed a step
    after it; ``(slowest, per worker)`` seconds from the kill to each worker's next
    completed step."""
    spec = loopback_cluster(2, WORKERS)
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
        tables[0].init_table(TABLE)
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
                    tables[w].push(TABLE, IDS, torch.ones(len(IDS), 16), lr=1.0, step=step)
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
            wait_until(lambda: errors or all(d and d[-1] > killed for d in done), timeout=60,
                       what="a step of every worker after the kill")
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
        rows = tables[0].pull(TABLE, IDS)
        exact = all(np.all(p == -acked) for p in params) and bool(torch.all(rows == -acked))
        print(f"  {acked} steps acknowledged; every shard and row holds each once: {exact}")
        return max(per), per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--grace", type=float, default=1.0,
                        help="seconds a primary must answer no Status before it is given up")
    parser.add_argument("--before", type=int, default=20, help="steps of each worker first")
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    firsts = []
    for kill in range(args.kills):
        first, per = one_kill(env, args.grace, args.before)
        firsts.append(first)
        print(f"kill {kill + 1}: every worker completed a step {first:.2f} s after the kill "
              f"(each worker's next step: {', '.join(f'{p:.2f}' for p in per)} s)")
    print(f"failover (kill -9 -> every worker's next completed step), grace {args.grace:g} s: "
          "median "
          f"{statistics.median(firsts):.2f} s, max {max(firsts):.2f} s over {args.kills} kills "
          f"(target <= 5 s)")


if __name__ == "__main__":
    main()
