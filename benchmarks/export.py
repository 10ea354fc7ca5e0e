"""Export for serving: time and bytes of a full export and a delta, load time, lookup latency.

A click model (``ShardedEmbedding(rows, 32, mode="sum")`` and a linear layer) is trained
on 2 ps tasks in this process (real ``Server``s on 127.0.0.1, authenticated gRPC,
Adagrad, async), with batches of 512 examples x 16 ids drawn from Zipf(1.2):

1. ``--warm`` steps, a training checkpoint (timed: the save of its dense parameters,
   table rows and Adagrad slots, streamed from the shards), then a full export of it
   (timed): its bytes against keys + rows (``rows x (dim x 4 + 8)``);
2. ``--delta-steps`` more steps, a checkpoint, and a delta on top of the full export:
   its bytes against the distinct rows those steps touched x (row bytes + 8);
3. ``serving.load`` of the chain (full + delta) into the model built anew (timed);
4. the loaded table's lookup of a batch of 512 x 16 ids (sum bags), p50 and p99 over
   ``--lookups`` calls, against ``nn.EmbeddingBag`` of the same size (mode sum) and, one
   row per id, the lookup module against ``nn.Embedding``, in the same run (the four
   alternated call by call).

Commands::

    python benchmarks/export.py                         # 2M x 32, ~1-2 minutes on 2 cores
    python benchmarks/export.py --rows 10000000         # the issue's 10M x 32 (~6 GB memory)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from towerflow import serving
from towerflow.checkpoint import CheckpointManager
from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.serving.lookup import FixedLookup
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks
from towerflow.training.session import checkpoint_metadata

DIM, BATCH, IDS = 32, 512, 16
SECRET = Credentials(secret=b"export-benchmark")


class Click(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(rows, DIM, mode="sum", name="emb")
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


def zipf_ids(rng: np.random.Generator, rows: int) -> torch.Tensor:
    return torch.from_numpy((rng.zipf(1.2, (BATCH, IDS)) - 1) % rows)


def dir_bytes(path: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def percentiles(modules: dict[str, nn.Module], ids: torch.Tensor, calls: int
                ) -> list[tuple[str, float, float]]:
    """p50 and p99 microseconds per call of each module, the modules alternated call by call
    so that the machine's load falls on them alike."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for index in range(calls + 20):
        for name, module in modules.items():
            start = time.perf_counter()
            module(ids)
            if index >= 20:  # the first calls warm up
                times[name].append(time.perf_counter() - start)
    out = []
    for name, spent in times.items():
        spent.sort()
        out.append((name, statistics.median(spent) * 1e6, spent[int(0.99 * (len(spent) - 1))] * 1e6))
    return out


def train(strategy: ParameterServer, rng: np.random.Generator, rows: int, steps: int,
          touched: set[int] | None = None) -> None:
    for _ in range(steps):
        ids = zipf_ids(rng, rows)
        if touched is not None:
            touched.update(np.unique(ids.numpy()).tolist())
        strategy.run_step(loss_fn, (ids, (ids[:, 0] % 2).float()))


def save(strategy: ParameterServer, manager: CheckpointManager) -> tuple[Path, float]:
    start = time.perf_counter()
    groups = strategy.state_dict()
    metadata = checkpoint_metadata(strategy)
    path = manager.save(metadata["step"], groups, metadata)
    return path, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="table rows (default 2M)")
    parser.add_argument("--warm", type=int, default=20, help="steps before the full export")
    parser.add_argument("--delta-steps", type=int, default=1000, help="steps the delta covers")
    parser.add_argument("--lookups", type=int, default=1000, help="timed lookups per module")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="export-bench-"))
    rng, touched = np.random.default_rng(0), set()
    manager = CheckpointManager(root / "train", max_to_keep=None)
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                   device="cpu", server=False)
        try:
            strategy.prepare(Click(args.rows), OptimizerConfig("adagrad", lr=0.1))
            train(strategy, rng, args.rows, args.warm)
            first, ckpt_s = save(strategy, manager)
            start = time.perf_counter()
            full = serving.export(first, root / "full")
            full_s = time.perf_counter() - start
            train(strategy, rng, args.rows, args.delta_steps, touched)
            second, ckpt2_s = save(strategy, manager)
            start = time.perf_counter()
            delta = serving.export(second, root / "delta", since=full)
            delta_s = time.perf_counter() - start
        finally:
            strategy.shutdown()
    start = time.perf_counter()
    model = serving.load([full, delta], Click(args.rows))
    load_s = time.perf_counter() - start
    weight = model.emb.weight.detach()
    bag = nn.EmbeddingBag(args.rows, DIM, mode="sum", _weight=weight.clone()).eval()
    plain = nn.Embedding(args.rows, DIM, _weight=weight.clone()).eval()
    one_row = FixedLookup(weight)
    ids = zipf_ids(np.random.default_rng(1), args.rows)
    with torch.no_grad():
        assert torch.allclose(model.emb(ids), bag(ids), atol=1e-5)
        lookups = percentiles({"loaded table (sum bags)": model.emb,
                               "nn.EmbeddingBag (sum)": bag,
                               "FixedLookup (one row per id)": one_row,
                               "nn.Embedding": plain}, ids, args.lookups)
    row_bytes = DIM * 4
    full_bytes, delta_bytes = dir_bytes(full), dir_bytes(delta)
    keys_rows = args.rows * (row_bytes + 8)
    touched_bytes = len(touched) * (row_bytes + 8)
    table = Table(title=f"{args.rows:,} x {DIM} table, 2 ps, torch threads "
                        f"{torch.get_num_threads()}")
    table.add_column("figure")
    table.add_column("result", justify="right")
    table.add_row("training checkpoint (rows + slots), s", f"{ckpt_s:.2f} / {ckpt2_s:.2f}")
    table.add_row("full export, s (vs first checkpoint)", f"{full_s:.2f} ({full_s / ckpt_s:.2f}x)")
    table.add_row("full export bytes / keys + rows", f"{full_bytes:,} / {keys_rows:,} = "
                  f"{full_bytes / keys_rows:.3f}x")
    table.add_row(f"delta after {args.delta_steps} steps, s", f"{delta_s:.2f}")
    table.add_row("delta bytes / touched rows x (row bytes + 8)",
                  f"{delta_bytes:,} / {touched_bytes:,} ({len(touched):,} rows) = "
                  f"{delta_bytes / touched_bytes:.3f}x")
    table.add_row("serving.load (full + delta), s", f"{load_s:.2f}")
    for name, p50, p99 in lookups:
        table.add_row(f"lookup 512 x 16 ids: {name}, p50 / p99 us", f"{p50:.0f} / {p99:.0f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
