"""ps faults with real processes: a killed ps, its restart from a checkpoint, duplicate pushes."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster, wait_until
from towerflow.testing.scenarios import STEP_LINE as STEP
from towerflow.testing.scenarios import TASK_COMMAND as TASK


@pytest.mark.slow
def test_killed_ps_gives_workers_unavailable_within_the_deadline_and_a_restart_resumes(
        subprocess_env, tmp_path):
    logdir = tmp_path / "train"
    args = ["--steps", "1000000", "--step-time", "0.01", "--logdir", str(logdir),
            "--save-secs", "0.3", "--timeout", "2", "--step-timeout", "2", "--print-every", "1"]
    with LocalCluster(loopback_cluster(1, 2), TASK + args, env=subprocess_env) as lc:
        ps = lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        manager = CheckpointManager(logdir)
        wait_until(lambda: logdir.exists() and len(manager.checkpoints()) >= 2, timeout=90,
                   what="two checkpoints by the chief")
        workers[1].wait_for_line(STEP, timeout=60)
        ps.kill()
        killed = time.monotonic()
        latest = manager.latest()
        assert latest is not None
        for worker in workers:  # an error within the deadline, never a hang
            assert worker.wait(timeout=60) == 3, worker.tail()
            worker.wait_for_line(r"^error UnavailableError: the ps task at 127\.0\.0\.1:\d+ did "
                                 r"not answer for \d+ s: call /towerflow\.ps\.PS/\w+ to "
                                 r"127\.0\.0\.1:\d+ failed with UNAVAILABLE", timeout=5)
        assert time.monotonic() - killed < 60
        reached = max(w.last_number(STEP) for w in workers)
        checkpointed = read_checkpoint(latest).step
        assert 0 < checkpointed <= reached + 2  # one push in flight per worker
        # restart the job: the chief restores the latest checkpoint on the new ps
        ps.start()
        target = ["--steps", str(checkpointed + 30)]
        restarted = [lc.start("worker", i, extra_args=target) for i in range(2)]
        ready = restarted[0].wait_for_line(r"^session ready at global step (\d+) \(restored "
                                           r"from (\d+)\)$", timeout=90)
        assert int(ready.group(2)) == checkpointed
        for worker in restarted:
            assert worker.wait(timeout=90) == 0, worker.tail()
            worker.wait_for_line(r"^finished at global step \d+", timeout=5)
    assert leftover_processes() == []


@pytest.mark.slow
def test_a_push_retried_after_a_lost_reply_is_applied_once_by_a_real_ps(subprocess_env):
    spec = loopback_cluster(1, 2)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        lc.start("ps", 0).wait_for_line(r"ps task 0 serving at", timeout=60)
        client = PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=1,
                          credentials=lc.credentials, timeout=10.0)
        try:
            client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                              aggregation=AggregationConfig(total_num_replicas=2))
            shard = client.shards[0]
            grad = np.ones(4, np.float32)
            first = shard.push(grad, worker_id=1, incarnation=5, seq=1, lr=1.0)
            retry = shard.push(grad, worker_id=1, incarnation=5, seq=1, lr=1.0)
            assert (first.status, first.duplicate, retry.status, retry.duplicate) == \
                ("applied", False, "applied", True)
            assert retry.step == first.step == 1
            # the same sequence number from a restarted worker (new incarnation) is new
            fresh = shard.push(grad, worker_id=1, incarnation=6, seq=1, lr=1.0)
            assert (fresh.status, fresh.duplicate, fresh.step) == ("applied", False, 2)
            params = np.empty(4, np.float32)
            client.pull([params])
            np.testing.assert_array_equal(params, np.full(4, -2.0, np.float32))
            stats = client.stats()[0]
            assert (stats["applied"], stats["duplicates"], stats["updates"]) == (2, 1, 2)
        finally:
            client.close(done=False)
    assert leftover_processes() == []


@pytest.mark.slow
def test_a_push_applied_before_a_checkpoint_is_not_applied_again_by_a_restored_ps(
        subprocess_env, tmp_path):
    """The (worker, incarnation, seq) table travels with the chief's checkpoint."""
    import torch

    from towerflow.checkpoint.format import write_checkpoint_dir
    from towerflow.cluster import TaskInfo
    from towerflow.strategies.base import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    spec = loopback_cluster(1, 2)

    def chief() -> ParameterServer:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=lc.credentials,
                                   server=False, timeout=10.0)
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        strategy.prepare(model, OptimizerConfig("sgd", lr=1.0))
        return strategy

    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        ps = lc.start("ps", 0)
        ps.wait_for_line(r"ps task 0 serving at", timeout=60)
        first = chief()
        assert first.global_step == 0  # the chief initialised the ps
        shard = first.client.shards[0]
        grad = np.ones(2, np.float32)
        assert shard.push(grad, worker_id=1, incarnation=500, seq=5, lr=1.0).status == "applied"
        groups = first.state_dict()
        path = write_checkpoint_dir(tmp_path / "ckpt", 1, groups,
                                    {"strategy": first.state_metadata()})
        first.shutdown()
        ps.kill()
        ps.start().wait_for_line(r"ps task 0 serving at", timeout=60)
        restored = chief()
        ckpt = read_checkpoint(path)
        restored.load_state(ckpt.groups, ckpt.metadata.get("strategy"))
        assert restored.global_step == 1
        shard = restored.client.shards[0]
        retry = shard.push(grad, worker_id=1, incarnation=500, seq=5, lr=1.0)
        assert retry.status == "applied" and retry.duplicate and retry.step == 1
        params = np.empty(2, np.float32)
        restored.client.pull([params])
        np.testing.assert_array_equal(params, [-1.0, -1.0])  # applied once, not twice
        assert restored.client.stats()[0]["duplicates"] == 1
        restored.shutdown()
    assert leftover_processes() == []
