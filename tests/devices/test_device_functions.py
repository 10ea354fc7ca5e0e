"""Device functions as scopes: towerflow.device(replica_device_setter(...)), ps pinning,
and the process's cluster task in placement (names, refusal of other tasks)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from test_placement import collect_placement_log
from torch import nn

import towerflow
from towerflow import _identity
from towerflow.cluster import ClusterSpec
from towerflow.devices import Operation, current_scope, device, parameter_placements
from towerflow.errors import InvalidArgumentError, PlacementError
from towerflow.ps.placement import placement_from_tasks

CLUSTER = ClusterSpec({"ps": ["127.0.0.1:1681", "127.0.0.1:1682"],
                       "worker": ["127.0.0.1:1683", "127.0.0.1:1684"]})
PS = "/job:ps/replica:0/task:{}/device:CPU:0"
WORKER0 = "/job:worker/replica:0/task:0/device:CPU:0"


@pytest.fixture
def worker0() -> Iterator[None]:
    """This process serves /job:worker/task:0 (what a started Server registers)."""
    token = _identity.register("worker", 0)
    try:
        yield
    finally:
        _identity.unregister(token)


@pytest.fixture
def placement_log() -> Iterator[list[str]]:
    yield from collect_placement_log()


def _devices(model: nn.Module) -> dict[str, str]:
    return {name: p.spec.to_string() for name, p in parameter_placements(model).items()}


def test_a_device_function_is_asked_about_each_operation() -> None:
    asked: list[Operation] = []

    def on_cpu(op: Operation) -> str:
        asked.append(op)
        return "/cpu:0"

    a = torch.ones(2, 2)
    with device(on_cpu):
        out = torch.matmul(a, a)
    assert out.device == torch.device("cpu")
    assert [(op.type, op.name) for op in asked] == [("matmul", "matmul")]


def test_a_device_function_answering_nonsense_is_refused_naming_it() -> None:
    def broken(op: Operation) -> int:
        return 3

    with device(broken), pytest.raises(
            InvalidArgumentError, match=r"The device function .*broken returned 3; a device "
                                        r"function must return a device name"):
        torch.ones(1)


def test_setter_scope_puts_parameters_on_ps_tasks_in_turn_and_compute_on_the_worker(
    worker0: None, placement_log: list[str],
) -> None:
    setter = towerflow.replica_device_setter(cluster=CLUSTER, worker_device="/job:worker/task:0")
    with device(setter):
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        out = model(torch.ones(2, 3))
    assert out.shape == (2, 1)
    assert _devices(model) == {"0.weight": PS.format(0), "0.bias": PS.format(1),
                               "2.weight": PS.format(0), "2.bias": PS.format(1)}
    assert f"0/weight: (aten::empty): {PS.format(0)}" in placement_log
    assert f"0/bias/uniform_: (aten::uniform_): {PS.format(1)}" in placement_log
    assert f"0/linear: (aten::addmm): {WORKER0}" in placement_log
    assert f"1/relu: (aten::relu): {WORKER0}" in placement_log


def test_greedy_and_partitioned_setters_decide_as_their_rule_says(worker0: None) -> None:
    greedy = towerflow.replica_device_setter(cluster=CLUSTER, ps_strategy="greedy",
                                             worker_device="/job:worker/task:0")
    with device(greedy):
        model = nn.Sequential(nn.Linear(100, 10), nn.Linear(10, 2))
    assert _devices(model) == {"0.weight": PS.format(0), "0.bias": PS.format(1),
                               "1.weight": PS.format(1), "1.bias": PS.format(1)}
    split = towerflow.replica_device_setter(cluster=CLUSTER, partition_threshold_bytes=1000,
                                            worker_device="/job:worker/task:0")
    with device(split):
        model = nn.Linear(100, 10)
    placed = _devices(model)
    assert placed == {"weight": PS.format(0), "bias": PS.format(0)}
    tasks = {name: int(spec.split("task:")[1][0]) for name, spec in placed.items()}
    plan = placement_from_tasks([(n, tuple(p.shape)) for n, p in model.named_parameters()],
                                tasks, 2, partition_threshold_bytes=1000)
    assert [[seg.label for seg in shard.segments] for shard in plan.shards] == [
        ["weight/part_0_of_2", "bias"], ["weight/part_1_of_2"]]


def test_a_ps_scope_pins_parameters_and_refuses_compute(worker0: None) -> None:
    with device("/job:ps/task:1"):
        layer = nn.Linear(2, 2)
        with pytest.raises(PlacementError, match=r"names /job:ps/replica:0/task:1, another "
                                                 r"task.* A ps task holds parameters"):
            torch.ones(2) + 1
    assert _devices(layer) == {"weight": PS.format(1), "bias": PS.format(1)}
    setter = towerflow.replica_device_setter(cluster=CLUSTER, worker_device="/job:worker/task:0")
    with device(setter):
        first = nn.Linear(2, 2)
        with device("/job:ps/task:1"):  # the inner scope wins
            second = nn.Linear(2, 2)
    assert _devices(first) == {"weight": PS.format(0), "bias": PS.format(1)}
    assert _devices(second) == {"weight": PS.format(1), "bias": PS.format(1)}


def test_log_names_this_process_task(worker0: None, placement_log: list[str]) -> None:
    torch.ones(2).sum()
    assert placement_log[-1] == f"sum: (aten::sum): {WORKER0}"


def test_compute_on_another_task_is_refused_naming_it_and_the_way_out(worker0: None) -> None:
    with device("/job:worker/task:1"), pytest.raises(PlacementError) as info:
        torch.ones(3)
    assert re.sub(r"'ones_\d+'", "'ones'", str(info.value)) == (
        "Cannot assign a device for operation 'ones': explicit device specification "
        "'/job:worker/task:1' names /job:worker/replica:0/task:1, another task, and this "
        "process is /job:worker/replica:0/task:0; towerflow runs operations only in their own "
        "task's process. Run this work in a process of /job:worker/replica:0/task:1 (start it "
        "there with towerflow.Server(cluster, 'worker', 1)), or keep the parameters on the ps "
        "tasks with towerflow.device(towerflow.replica_device_setter(cluster=cluster, "
        "worker_device='/job:worker/task:0'))."
    )
    with device("/job:worker/task:0"):  # this process's own task runs here
        assert torch.ones(1).device == torch.device("cpu")


def test_outside_a_cluster_a_task_scope_is_refused_not_run_locally() -> None:
    assert not _identity.in_cluster()
    with device("/job:worker/task:1"), pytest.raises(
            PlacementError, match=r"this process is /job:localhost/replica:0/task:0"):
        torch.ones(3)
    with device("/job:localhost/task:0/cpu:0"):
        assert torch.ones(1).device == torch.device("cpu")


def test_current_scope_under_a_setter_is_the_worker_device() -> None:
    setter = towerflow.replica_device_setter(ps_tasks=2, worker_device="/job:worker/task:3")
    with device(setter):
        assert current_scope() == towerflow.DeviceSpec.from_string("/job:worker/task:3")
    assert current_scope() is None
