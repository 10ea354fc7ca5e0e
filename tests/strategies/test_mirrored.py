"""Mirrored strategy: replica environment, and N replicas == one replica with N x the batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from towerflow.errors import InvalidArgumentError
from towerflow.strategies.mirrored import ReplicaEnv
from towerflow.testing.replicas import run_replicas

# One replica of the equivalence test: rank r initialises with seed r (so only
# DDP's broadcast of rank 0 makes them equal), takes its half of a fixed
# batch, runs two momentum-SGD steps and saves its parameters.
_REPLICA = r"""
import sys, torch
import towerflow
from towerflow.models import Cifar10Net, cross_entropy_loss
from towerflow.strategies.base import OptimizerConfig
from towerflow.strategies.mirrored import Mirrored

out, per_replica = sys.argv[1], int(sys.argv[2])
strategy = Mirrored(timeout_s=60)
torch.manual_seed(strategy.rank)
model = strategy.prepare(Cifar10Net(), OptimizerConfig("momentum", lr=0.05, momentum=0.9))
g = torch.Generator().manual_seed(42)
images = torch.randn(2 * per_replica, 3, 24, 24, generator=g)
labels = torch.randint(0, 10, (2 * per_replica,), generator=g)
mine = slice(strategy.rank * per_replica, (strategy.rank + 1) * per_replica)
for _ in range(2):
    strategy.run_step(cross_entropy_loss, (images[mine], labels[mine]))
towerflow.save(strategy.model, f"{out}/rank{strategy.rank}")
from towerflow import _identity
print("devices of", _identity.prefix(), flush=True)
strategy.shutdown()
"""


def _reference(per_replica: int) -> dict[str, torch.Tensor]:
    from towerflow.models import Cifar10Net, cross_entropy_loss
    from towerflow.strategies.base import OptimizerConfig
    from towerflow.strategies.single import SingleDevice

    strategy = SingleDevice("/cpu:0")
    torch.manual_seed(0)
    strategy.prepare(Cifar10Net(), OptimizerConfig("momentum", lr=0.05, momentum=0.9))
    g = torch.Generator().manual_seed(42)
    images = torch.randn(2 * per_replica, 3, 24, 24, generator=g)
    labels = torch.randint(0, 10, (2 * per_replica,), generator=g)
    for _ in range(2):
        strategy.run_step(cross_entropy_loss, (images, labels))
    return {k: v.detach() for k, v in strategy.model.state_dict().items()}


@pytest.mark.slow
def test_two_gloo_replicas_match_one_replica_with_twice_the_batch(
        tmp_path: Path, free_ports, subprocess_env, python) -> None:
    from towerflow import load

    results = run_replicas([python, "-c", _REPLICA, str(tmp_path), "4"], world_size=2,
                           port=free_ports(1)[0], env=subprocess_env)
    assert [status for status, _ in results] == [0, 0], results
    for rank, (_, output) in enumerate(results):  # each replica names itself (placement log)
        assert f"devices of /job:worker/replica:0/task:{rank}\n" in output, output
    expected = _reference(per_replica=4)
    replicas = [load(tmp_path / f"rank{r}") for r in range(2)]
    for name, want in expected.items():
        torch.testing.assert_close(replicas[0][name], replicas[1][name], rtol=0, atol=0)
        torch.testing.assert_close(replicas[0][name], want, rtol=1e-4, atol=1e-5)


def test_replica_env_reads_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    assert ReplicaEnv.from_env(env) == ReplicaEnv(3, 4, 1, "10.0.0.1", 29500)


def test_replica_env_without_any_variables_is_a_world_of_one() -> None:
    replica = ReplicaEnv.from_env({})
    assert (replica.rank, replica.world_size, replica.master_addr) == (0, 1, "127.0.0.1")


def test_incomplete_torchrun_environment_names_the_missing_variables() -> None:
    with pytest.raises(InvalidArgumentError, match="MASTER_ADDR, MASTER_PORT not set"):
        ReplicaEnv.from_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_rank_outside_the_world_is_refused() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(InvalidArgumentError, match=r"rank 2 is outside a world of 2"):
        ReplicaEnv.from_env(env)


def test_tf_config_orders_chief_then_workers_and_meets_at_the_chief() -> None:
    cluster = {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    replica = ReplicaEnv.from_env({"TF_CONFIG": tf_config})
    assert replica == ReplicaEnv(2, 3, 0, "host0", 2222, 1)


def test_tf_config_with_a_ps_job_points_to_the_parameter_server_strategy() -> None:
    cluster = {"ps": ["h:1"], "worker": ["h:2"]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    with pytest.raises(InvalidArgumentError, match="names a 'ps' job.*ParameterServer"):
        ReplicaEnv.from_env({"TF_CONFIG": tf_config})


def test_mirrored_world_of_one_trains_and_reports_its_place() -> None:
    from towerflow.strategies.base import OptimizerConfig
    from towerflow.strategies.mirrored import Mirrored

    strategy = Mirrored(device="cpu", env={}, timeout_s=30)
    try:
        model = strategy.prepare(torch.nn.Linear(3, 1), OptimizerConfig(lr=0.1))
        batch = (torch.ones(2, 3), torch.zeros(2, 1))
        result = strategy.run_step(
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), batch)
        assert (strategy.rank, strategy.world_size, strategy.backend) == (0, 1, "gloo")
        assert result.global_step == 1
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        strategy.check_restored_step(0)
        assert float(strategy.reduce_mean(torch.tensor(3.0))) == 3.0
    finally:
        strategy.shutdown()


def _slurm_task(procid: int, localid: int, node: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURMD_NODENAME": node,
            "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_NTASKS": "4", "TOWERFLOW_PORT": "2400"}  # fmt: skip


@pytest.mark.parametrize(("procid", "localid", "node"), [(0, 0, "node01"), (1, 1, "node01"),
                                                         (2, 0, "node02"), (3, 1, "node02")])
def test_slurm_replicas_of_a_node_take_their_slurm_local_id_as_local_rank(procid, localid, node) -> None:
    from towerflow.cluster import resolve_cluster

    env = _slurm_task(procid, localid, node)
    cluster, task = resolve_cluster(env=env)
    replica = ReplicaEnv.from_cluster(cluster, task, env)
    assert replica == ReplicaEnv(procid, 4, localid, "node01", 2400, 2)
    assert ReplicaEnv.from_cluster(cluster, task, {**env, "LOCAL_RANK": "0"}).local_rank == 0


def test_each_replica_of_a_node_computes_on_the_gpu_of_its_local_rank(monkeypatch) -> None:
    from towerflow.cluster import resolve_cluster
    from towerflow.strategies.mirrored import replica_device

    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    devices = []
    for procid in range(4):
        env = _slurm_task(procid, procid % 2, f"node0{procid // 2 + 1}")
        replica = ReplicaEnv.from_cluster(*resolve_cluster(env=env), env)
        assert replica.local_world_size == 2  # not the world of 4: no CPU fallback
        devices.append(replica_device(replica.local_rank, gpus=2))
    assert devices == chosen == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert replica_device(1, "cpu", gpus=2) == torch.device("cpu")
    with pytest.raises(InvalidArgumentError, match=r"local rank 1 .* needs GPU 1 but 1 GPU\(s\) are visible.*--gpus-per-task.*device='cpu'"):
        replica_device(1, gpus=1)


# One replica of the restore test: replica 0 alone "reads" each checkpoint (any other
# replica that calls its reader fails), and every replica reports what it received.
_RESTORE = r"""
import json, torch
from pathlib import Path
from towerflow.checkpoint import Checkpoint
from towerflow.errors import CheckpointError, TowerflowError
from towerflow.strategies.mirrored import Mirrored

strategy = Mirrored(timeout_s=60)
rank = strategy.rank

def never():
    raise AssertionError(f"replica {rank} read its own train dir")

def at_chief(read):
    return read if rank == 0 else never

def damaged():
    raise CheckpointError("every checkpoint in /chief/train is damaged")

tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
           "flag": torch.tensor([True, False]), "count": torch.tensor(7),
           "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16), "none": torch.empty(0, 4)}
ckpt = Checkpoint(Path("/chief/train/ckpt-00000009"), 9, {"model": tensors, "ema": {"w": tensors["w"] * 2}},
                  {"step": 9, "data": {"epoch": 1, "offset": 48}})
got = strategy.restore_checkpoint(at_chief(lambda: ckpt))
nothing = strategy.restore_checkpoint(at_chief(lambda: None))
try:
    strategy.restore_checkpoint(at_chief(damaged))
    error = None
except TowerflowError as exc:
    error = f"{type(exc).__name__}: {exc}"
same = [(g, n) for g in ckpt.groups for n in ckpt.groups[g]
        if torch.equal(got.groups[g][n], ckpt.groups[g][n])
        and got.groups[g][n].dtype == ckpt.groups[g][n].dtype]
print("RESULT " + json.dumps({"path": str(got.path), "step": got.step, "metadata": got.metadata,
                              "same": len(same), "nothing": nothing is None, "error": error}))
strategy.shutdown()
"""


@pytest.mark.slow
def test_replica_0_alone_reads_the_checkpoint_and_every_replica_receives_it(
        free_ports, subprocess_env, python) -> None:
    results = run_replicas([python, "-c", _RESTORE], world_size=2, port=free_ports(1)[0],
                           env=subprocess_env, timeout=60)
    assert [status for status, _ in results] == [0, 0], results
    facts = [json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) for _, out in results]
    for fact in facts:
        assert (fact["path"], fact["step"]) == ("/chief/train/ckpt-00000009", 9)
        assert fact["metadata"] == {"step": 9, "data": {"epoch": 1, "offset": 48}}
        assert fact["same"] == 6 and fact["nothing"] is True  # 6 tensors, bit for bit
    assert facts[0]["error"] == "CheckpointError: every checkpoint in /chief/train is damaged"
    assert re.fullmatch(r"AbortedError: replica 0 could not restore the checkpoint every replica "
                        r"resumes from \(CheckpointError: every checkpoint in /chief/train is "
                        r"damaged\); fix its train dir and start the replicas again\.",
                        facts[1]["error"])


# One replica under the Supervisor: rank r starts from seed r; the chief (rank 0) saves
# in its own logdir, and its init_fn sets every weight to 7 when it finds no checkpoint;
# every replica reports its step and parameters when the session opens.
_SUPERVISED = r"""
import json, os, sys, torch, towerflow
from towerflow.strategies.base import OptimizerConfig

rank, root, steps = int(os.environ["RANK"]), sys.argv[1], int(sys.argv[2])
torch.manual_seed(rank)
sv = towerflow.Supervisor(is_chief=rank == 0, logdir=f"{root}/node{rank}", save_model_secs=0,
                          init_fn=lambda model: model.weight.fill_(7.0))
x, y = torch.ones(4, 3), torch.zeros(4, 1)
loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
with sv.managed_session(model=torch.nn.Linear(3, 1),
                        optimizer=OptimizerConfig("momentum", lr=0.1, momentum=0.9)) as sess:
    start = [sess.global_step, sess.strategy.model.weight.tolist()]
    while sess.global_step < steps:
        sess.run_step(loss, (x, y))
    end = sess.strategy.model.weight.tolist()
print("RESULT " + json.dumps({"start": start, "end": end, "kind": type(sess.strategy).__name__}))
"""


@pytest.mark.slow
def test_supervised_replicas_start_from_the_chiefs_init_fn_and_resume_from_its_logdir_alone(
        tmp_path: Path, free_ports, subprocess_env, python) -> None:
    def run(steps: int) -> list[dict]:
        results = run_replicas([python, "-c", _SUPERVISED, str(tmp_path), str(steps)],
                               world_size=2, port=free_ports(1)[0], env=subprocess_env,
                               timeout=60)
        assert [status for status, _ in results] == [0, 0], results
        return [json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) for _, out in results]

    first = run(3)
    assert [f["kind"] for f in first] == ["Mirrored", "Mirrored"]
    # a fresh start: every replica starts from the chief's init_fn (DDP copied replica 0's
    # weights before init_fn ran), not from its own seed
    assert [f["start"] for f in first] == [[0, [[7.0, 7.0, 7.0]]], [0, [[7.0, 7.0, 7.0]]]]
    assert first[0]["end"] == first[1]["end"]
    again = run(5)
    # a restart restores the chief's checkpoint; init_fn does not run again
    assert [f["start"] for f in again] == [[3, first[0]["end"]], [3, first[0]["end"]]]
    assert again[0]["end"] == again[1]["end"]
    assert not list((tmp_path / "node1").glob("ckpt-*"))


