"""Which device an all-reduce replica computes on: one rule (``replica_device``) for every
way replicas start, tested with the visible GPUs given (no GPU needed), then as real
replicas on a machine whose GPUs are simulated, and (with a GPU) on the real one."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch

from towerflow.errors import InvalidArgumentError
from towerflow.strategies.mirrored import ReplicaEnv, replica_device

FALLBACK = "replicas run on this machine but"


@pytest.fixture
def set_devices(monkeypatch) -> list[torch.device]:
    """The GPUs made current (``torch.cuda.set_device``), recorded instead of set."""
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def _devices(replicas: int, gpus: int, device: str | None = None, *,
             whole_world_here: bool = True) -> list[torch.device]:
    return [replica_device(rank, device, gpus=gpus,
                           local_replicas=replicas if whole_world_here else None)
            for rank in range(replicas)]


def test_more_replicas_than_gpus_and_no_device_named_put_every_replica_on_the_cpu_in_one_line(
        caplog, set_devices) -> None:
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        assert _devices(2, 1) == [torch.device("cpu")] * 2
        assert _devices(3, 2) == [torch.device("cpu")] * 3
    assert set_devices == []  # no replica took a GPU: they all run Gloo
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"{n} replicas run on this machine but {g} GPU(s) are visible (NCCL runs one replica "
        "per GPU): every replica runs on the CPU with Gloo; to train on the GPUs start at most "
        f"{g} replica(s) per machine, or name device='cpu' (towerflow train --device cpu) to "
        "choose the CPU without this line." for n, g in ((2, 1), (3, 2))]


def test_as_many_gpus_as_replicas_give_each_replica_the_gpu_of_its_local_rank(
        caplog, set_devices) -> None:
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        assert _devices(2, 2) == set_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
        assert _devices(2, 0) == [torch.device("cpu")] * 2  # a machine without GPUs: no line
        assert _devices(2, 0, whole_world_here=False) == [torch.device("cpu")] * 2
    assert caplog.records == []


def test_a_world_across_machines_with_too_few_gpus_here_is_refused_not_split_across_backends(
        set_devices) -> None:
    # each machine deciding alone could put some replicas on NCCL and the others on Gloo
    assert replica_device(0, gpus=1) == torch.device("cuda", 0)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "Replica with local rank 1 (LOCAL_RANK or SLURM_LOCALID) needs GPU 1 but 1 GPU(s) "
            "are visible; start at most 1 replicas per machine, let every replica of a machine "
            "see all of its GPUs (under Slurm: no --gpus-per-task or --gpu-bind), or run every "
            "replica on the CPU (device='cpu', towerflow train --device cpu).")):
        replica_device(1, gpus=1)


@pytest.mark.parametrize("named", ["cuda", "/gpu", "/device:GPU"])
def test_a_gpu_named_without_its_index_is_the_local_ranks_and_refused_when_missing(
        named, caplog, set_devices) -> None:
    assert replica_device(0, named, local_replicas=2, gpus=1) == torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="towerflow.training"), pytest.raises(
            InvalidArgumentError, match=re.escape(
                f"local rank 1 (LOCAL_RANK or SLURM_LOCALID) needs device {named!r} (GPU 1) but "
                "1 GPU(s) are visible; start at most 1 replicas per machine")
            + r".*device='cpu'"):
        replica_device(1, named, local_replicas=2, gpus=1)
    with pytest.raises(InvalidArgumentError, match=r"needs device 'cuda' \(GPU 0\) but 0 GPU"):
        replica_device(0, "cuda", local_replicas=1, gpus=0)
    assert caplog.records == []  # a device the user named: done or refused, never replaced
    assert set_devices == [torch.device("cuda", 0)]


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_device_cpu_puts_every_replica_on_the_cpu_without_a_line(gpus, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        assert _devices(2, gpus, "cpu") == [torch.device("cpu")] * 2
        assert _devices(2, gpus, "/cpu:0", whole_world_here=False) == [torch.device("cpu")] * 2
    assert caplog.records == []


def test_towerflow_device_cpu_chooses_the_cpu_for_every_replica(monkeypatch, caplog) -> None:
    monkeypatch.setenv("TOWERFLOW_DEVICE", "cpu")
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        assert _devices(2, 4) == [torch.device("cpu")] * 2
        assert _devices(4, 1) == [torch.device("cpu")] * 4
    assert caplog.records == []


def test_the_replicas_of_a_machine_are_counted_from_every_way_replicas_start() -> None:
    from towerflow.cluster import ClusterSpec, TaskInfo
    from towerflow.cluster.launcher import replica_env

    # towerflow train --replicas 2 / spawn_replicas: torchrun's variables, LOCAL_WORLD_SIZE
    spawned = [ReplicaEnv.from_env(replica_env(rank, 2, 29500, base={})) for rank in (0, 1)]
    assert [(r.local_rank, r.local_world_size, r.world_size) for r in spawned] == [(0, 2, 2),
                                                                                 (1, 2, 2)]
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
    assert ReplicaEnv.from_env({**torchrun, "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    assert ReplicaEnv.from_env(torchrun).local_world_size is None  # unknown
    # by hand, meeting on loopback: the whole world is on this machine
    assert ReplicaEnv.from_env({**torchrun, "MASTER_ADDR": "127.0.0.1"}).local_world_size == 4
    # a cluster of loopback tasks (towerflow launch --ps 0 --workers 2): one GPU each
    spec = ClusterSpec({"worker": ["localhost:1", "127.0.0.1:2"]})
    local = [ReplicaEnv.from_cluster(spec, TaskInfo("worker", i), env={}) for i in (0, 1)]
    assert [(r.local_rank, r.local_world_size) for r in local] == [(0, 2), (1, 2)]
    spread = ClusterSpec({"chief": ["a:1"], "worker": ["b:1", "b:2"]})
    assert [(r.local_rank, r.local_world_size) for r in (
        ReplicaEnv.from_cluster(spread, t, env={}) for t in spread.replicas)] == [
        (0, 1), (0, 2), (1, 2)]
    with pytest.raises(InvalidArgumentError, match=r"LOCAL_WORLD_SIZE=0 must be at least 1"):
        ReplicaEnv.from_env({**torchrun, "LOCAL_WORLD_SIZE": "0"})


# One replica: Mirrored with no device named, on a machine of `gpus` simulated GPUs
# ("real": the machine's own); it says where it runs.
_REPLICA = r"""
import sys
from towerflow.devices.local import GpuProperties, SimulatedCudaRuntime, use_cuda_runtime
from towerflow.strategies.mirrored import Mirrored

def mirrored():
    if sys.argv[1] == "real":
        return Mirrored(timeout_s=60)
    gpus = [GpuProperties("Simulated GPU", 80 << 30, 9, 0)] * int(sys.argv[1])
    with use_cuda_runtime(SimulatedCudaRuntime(gpus)):
        return Mirrored(timeout_s=60)

strategy = mirrored()
print(f"replica {strategy.rank} on {strategy.device} with {strategy.backend}", flush=True)
strategy.shutdown()
"""

_SPAWN = ("import sys; from towerflow.cluster.launcher import spawn_replicas; "
          "sys.exit(spawn_replicas(sys.argv[2:], int(sys.argv[1])))")


def _spawn(replicas: int, gpus: str, env: dict[str, str]) -> tuple[list[str], str]:
    proc = subprocess.run([sys.executable, "-c", _SPAWN, str(replicas), sys.executable, "-c",
                           _REPLICA, gpus], env=env, capture_output=True, text=True,
                          timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    return sorted(re.findall(r"replica \d on \S+ with \w+", text)), text


@pytest.mark.slow
def test_replicas_spawned_on_a_machine_with_fewer_gpus_all_train_on_the_cpu(
        subprocess_env) -> None:
    subprocess_env.pop("CUDA_VISIBLE_DEVICES", None)  # every simulated GPU visible
    places, text = _spawn(2, "1", subprocess_env)
    assert places == ["replica 0 on cpu with gloo", "replica 1 on cpu with gloo"], text
    assert text.count(f"2 {FALLBACK} 1 GPU(s) are visible") == text.count(FALLBACK) == 1, text


@pytest.mark.slow
@pytest.mark.gpu
def test_one_replica_more_than_the_gpus_trains_on_the_cpu_on_a_real_gpu_machine(
        subprocess_env) -> None:
    gpus = torch.cuda.device_count()
    places, text = _spawn(gpus + 1, "real", subprocess_env)
    assert places == [f"replica {r} on cpu with gloo" for r in range(gpus + 1)], text
    assert text.count(f"{gpus + 1} {FALLBACK} {gpus} GPU(s) are visible") == 1, text
