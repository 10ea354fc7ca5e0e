"""``ParameterServer(replicas=1)`` goes on training when a ps task is killed (kill -9) mid-run:
its steps and its checkpoint read each shard from the task serving it, and its dense and table
calls share one route per shard (real ps processes on 127.0.0.1)."""

from __future__ import annotations

import sys

import pytest
import replica_calls as calls
import torch

from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing import LocalCluster, loopback_cluster


@pytest.mark.slow
def test_training_goes_on_and_checkpoints_after_a_ps_task_is_killed(subprocess_env) -> None:
    spec = loopback_cluster(2, 1)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        ps = [lc.start("ps", i) for i in range(2)]
        for i, task in enumerate(ps):
            task.wait_for_line(rf"ps task {i} serving at", timeout=60)
        one = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")})
        run = ParameterServer(one, TaskInfo("worker", 0), device="cpu", server=False,
                              credentials=lc.credentials, replicas=1, whole_table_bytes=None)
        try:
            run.prepare(calls.Clicks(), OptimizerConfig("adagrad", lr=0.1))
            g = torch.Generator().manual_seed(1)

            def step() -> int:
                ids = torch.randint(0, 50, (16,), generator=g)
                return run.run_step(lambda m, b: m(b).square().mean(), ids).global_step

            for _ in range(4):
                step()
            ps[0].kill()  # SIGKILL: its shard's copy on ps task 1 takes over
            steps = [step() for _ in range(4)]
            run.settle()
            state = run.state_dict()  # a checkpoint: shard 0 read from its new primary
            assert run.state_metadata()["global_step"] == steps[-1] == 8
            assert "model" in state
            assert [s.route.where() for s in run.client.shards] == [(1, 2), (1, 1)]
            # the table calls go by the same routes: one switch served both
            assert run._tables.client._routing.routes[0] is run.client.shards[0].route
        finally:
            run.shutdown()
