"""A ps task or a worker training a tiny click model on a sparse table (tests of sparse tables).

    python sparse_click.py --cluster '{"ps": [...], "worker": [...]}' --job ps --index 0
    python sparse_click.py --cluster ... --job worker --index 1 --num-rows 5000 --steps 100 \
        --report out.json

A worker writes a JSON report: first and final loss (mean of 10 steps), the
last global step it saw, the updates each table shard had applied after its
last step (``--mode``: async, sync or ssp; ``--defer``: deferred row pushes)
and its peak resident memory in bytes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

import towerflow
from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer


class Click(nn.Module):
    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(num_rows, dim, mode="sum",
                                    initializer={"kind": "constant", "value": 0.0})
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


def _peak_rss() -> int:
    """This process's own peak RSS in bytes (VmHWM). Not ru_maxrss: Linux carries the parent's
    high-water mark across fork and exec, so a child of a large test process reports its parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def batches(num_rows: int, seed: int):
    """Ids from a small hot set; an example clicks when its ids' planted weights sum > 0."""
    gen = torch.Generator().manual_seed(seed)
    hot = 500
    truth = torch.randn(hot, generator=torch.Generator().manual_seed(7))
    stride = max(1, num_rows // hot)
    while True:
        picks = torch.randint(0, hot, (256, 8), generator=gen)
        labels = (truth[picks].sum(1) > 0).float()
        yield picks * stride, labels


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--num-rows", type=int, default=5000)
    parser.add_argument("--dim", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--report")
    parser.add_argument("--mode", default="async")
    parser.add_argument("--defer", action="store_true")
    args = parser.parse_args()
    cluster = ClusterSpec(json.loads(args.cluster))
    if args.job == "ps":
        towerflow.Server(cluster, "ps", args.index).join()
        return 0
    torch.manual_seed(0)
    strategy = ParameterServer(cluster, TaskInfo("worker", args.index), mode=args.mode,
                               device="cpu", server=False, step_timeout=60.0)
    model = Click(args.num_rows, args.dim)
    model.emb.defer_push = args.defer
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
    losses, step, applied = [], 0, []
    try:
        for _, batch in zip(range(args.steps), batches(args.num_rows, args.index), strict=False):
            result = strategy.run_step(loss_fn, batch)
            losses.append(float(result.loss))
            step = result.global_step
        client, config = model.emb.client, model.emb.config
        applied = [client.status(config, s).applied for s in range(client.num_shards)]
    finally:
        strategy.shutdown()
    peak = _peak_rss()
    report = {"first_loss": sum(losses[:10]) / 10, "final_loss": sum(losses[-10:]) / 10,
              "global_step": step, "peak_rss": peak, "table_applied": applied}
    with open(args.report, "w") as f:
        json.dump(report, f)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
