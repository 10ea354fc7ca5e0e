"""A ps task, or a chief that checkpoints a large sparse table and reports its peak memory.

    python table_checkpoint_rss.py --cluster '{"ps": [...], "worker": [...]}' --job ps --index 0
    python table_checkpoint_rss.py --cluster ... --job worker --index 0 --num-rows 300000 \
        --dim 32 --part-bytes 2097152 --train-dir /tmp/run --report out.json

The chief trains one step, saves a checkpoint (the table streamed from the ps
tasks part by part), then imports it back into the ps tasks from the
checkpoint's parts, and writes a JSON report: for each phase its resident
memory when the phase starts and its peak during the phase (bytes; Linux's
VmRSS and VmHWM, the peak reset through ``/proc/self/clear_refs`` first), the
number of part files and the rows restored.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import towerflow
from towerflow.checkpoint import CheckpointManager
from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.ps.worker.tables.checkpoint import TABLES_GROUP, TABLES_KEY, import_tables
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.training.session import checkpoint_metadata


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert found is not None, key
    return int(found.group(1)) * 1024


def measure(report: dict[str, Any], phase: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; record the resident memory before it and the peak while it ran."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    report[f"rss_before_{phase}"] = _status("VmRSS")
    result = fn()
    report[f"peak_during_{phase}"] = _status("VmHWM")
    return result


class Model(nn.Module):
    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(num_rows, dim, mode="sum", name="emb")
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


def chief(cluster: ClusterSpec, args: argparse.Namespace) -> dict[str, Any]:
    strategy = ParameterServer(cluster, TaskInfo("worker", 0), device="cpu", server=False,
                               table_part_bytes=args.part_bytes)
    model = Model(args.num_rows, args.dim)
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
    report: dict[str, Any] = {}
    try:
        gen = torch.Generator().manual_seed(0)
        batch = (torch.randint(0, args.num_rows, (64, 4), generator=gen),
                 torch.randint(0, 2, (64,), generator=gen).float())
        strategy.run_step(loss_fn, batch)
        manager = CheckpointManager(args.train_dir)

        def save() -> Any:
            groups = strategy.state_dict()
            metadata = checkpoint_metadata(strategy)
            return manager.save(metadata["step"], groups, metadata)

        report["checkpoint"] = str(measure(report, "save", save))
        ckpt = measure(report, "read", manager.restore)  # every part verified
        reader = ckpt.chunked[TABLES_GROUP]
        report["parts"] = len(reader)
        report["restored_rows"] = sum(info["rows"] for info in reader.infos)
        measure(report, "restore", lambda: import_tables(
            strategy._tables.client, [model.emb.config], reader,
            ckpt.metadata["strategy"][TABLES_KEY]))
    finally:
        strategy.shutdown()
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--num-rows", type=int, default=300_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--part-bytes", type=int, default=2 << 20)
    parser.add_argument("--train-dir")
    parser.add_argument("--report")
    args = parser.parse_args()
    cluster = ClusterSpec(json.loads(args.cluster))
    if args.job == "ps":
        towerflow.Server(cluster, "ps", args.index).join()
        return 0
    report = chief(cluster, args)
    with open(args.report, "w") as f:
        json.dump(report, f)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
