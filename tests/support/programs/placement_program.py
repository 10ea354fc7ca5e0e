"""A cluster task for the placement tests, written the way article 003's readers write one.

Started by hand (``TF_CONFIG`` names its task): a ps task serves until stopped;
a worker starts its ``Server``, turns the placement log on, builds its model
inside ``towerflow.device(towerflow.replica_device_setter(...))``, tries to
compute on the other worker's task, and (worker 0, the chief) trains three
steps through a ``ParameterServer`` given no ``device_setter=``.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import towerflow
from towerflow.cluster import resolve_cluster
from towerflow.devices import parameter_placements
from towerflow.strategies import OptimizerConfig, ParameterServer


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def main() -> int:
    cluster, task = resolve_cluster()
    server = towerflow.Server(cluster, task.job_name, task.task_index)
    if task.job_name == "ps":
        server.join()
        return 0
    towerflow.configure(log_device_placement=True)
    setter = towerflow.replica_device_setter(
        cluster=cluster, worker_device=f"/job:worker/task:{task.task_index}")
    with towerflow.device(setter):
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        model(torch.ones(2, 3))
    scope = {n: p.spec.to_string() for n, p in parameter_placements(model).items()}
    print("scope:", json.dumps(scope), flush=True)
    other = 1 - task.task_index
    try:
        with towerflow.device(f"/job:worker/task:{other}"):
            torch.ones(3)
        print("not refused", flush=True)
    except towerflow.PlacementError as exc:
        print("refused:", exc, flush=True)
    if task.task_index == 0:
        strategy = ParameterServer(cluster, task, server=server)
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
        placed = {seg.name: f"/job:ps/replica:0/task:{shard.index}/device:CPU:0"
                  for shard in strategy.client.placement.shards for seg in shard.segments}
        print("strategy:", json.dumps(placed), flush=True)
        x = torch.randn(8, 3)
        batch = (x, x.sum(1, keepdim=True))
        for _ in range(3):
            result = strategy.run_step(_loss, batch)
        print("global step:", result.global_step, flush=True)
        strategy.shutdown()
    server.stop()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
