"""Where the row path beats the dense path: one embedding bag, both ways, by table size.

Workload: an ``nn.EmbeddingBag(rows, 32, mode="sum")`` and a linear layer
under the ``ParameterServer`` strategy, 2 ps tasks and the worker in this
process (gRPC on 127.0.0.1), Adagrad, async, batches of 512 x 16 Zipf(1.2)
ids, one torch thread. Each size is trained twice: kept dense
(``sparse_threshold_bytes=None``: the whole weight travels each way every
step) and swapped for a row-sharded table (``sparse=True``: only the batch's
unique rows travel). The figure is the mean step time after one warm-up
step; the default threshold of a model's embeddings
(``towerflow.ps.worker.tables.swap.DEFAULT_SPARSE_THRESHOLD``) must lie well
above the size where the row path starts to win.

Commands::

    python benchmarks/sparse_default_threshold.py
    python benchmarks/sparse_default_threshold.py --mib 0.0625 0.25 1 4 16 64 --steps 20
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from towerflow.cluster import ClusterSpec, Server, ServerOptions, TaskInfo
from towerflow.cluster.launcher import free_ports
from towerflow.cluster.transport import Credentials
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

DIM, BATCH, IDS = 32, 512, 16
SECRET = Credentials(secret=b"threshold-bench")


def step_seconds(rows: int, sparse: bool, steps: int) -> float:
    """Mean seconds per step of the bag of ``rows`` rows, as a table (``sparse``) or dense."""
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                        "worker": [f"127.0.0.1:{ports[2]}"]})
    servers = [Server(spec, "ps", i, credentials=SECRET,
                      options=ServerOptions(serve_forever=True)) for i in range(2)]
    model = nn.Sequential(nn.EmbeddingBag(rows, DIM, mode="sum", sparse=sparse),
                          nn.Linear(DIM, 1))
    strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET, device="cpu",
                               server=False, sparse_threshold_bytes=1 if sparse else None)
    try:
        strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
        rng = np.random.default_rng(0)
        batches = [torch.from_numpy((rng.zipf(1.2, size=(BATCH, IDS)) - 1) % rows)
                   for _ in range(8)]

        def loss_fn(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return m(ids).square().mean()

        strategy.run_step(loss_fn, batches[0])
        start = time.perf_counter()
        for i in range(steps):
            strategy.run_step(loss_fn, batches[i % len(batches)])
        return (time.perf_counter() - start) / steps
    finally:
        strategy.shutdown()
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[0.0625, 0.25, 1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for mib in args.mib:
        rows = int(mib * (1 << 20)) // (DIM * 4)
        dense, table = step_seconds(rows, False, args.steps), step_seconds(rows, True, args.steps)
        print(f"{mib:8.4g} MiB ({rows:,} rows): dense {dense * 1e3:7.1f} ms/step, rows "
              f"{table * 1e3:6.1f} ms/step, rows / dense {table / dense:.2f}", flush=True)


if __name__ == "__main__":
    main()
