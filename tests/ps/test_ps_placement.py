"""Placement of variables on ps tasks: replica_device_setter and its choosers."""

from __future__ import annotations

import pytest

from towerflow.cluster import ClusterSpec
from towerflow.errors import InvalidArgumentError
from towerflow.ps import replica_device_setter
from towerflow.ps.placement import plan_placement

CLUSTER = ClusterSpec({"ps": ["localhost:1681", "localhost:1684"],
                       "worker": ["localhost:1682", "localhost:1683"]})


def test_round_robin_assigns_variables_to_ps_tasks_in_turn() -> None:
    setter = replica_device_setter(cluster=CLUSTER, worker_device="/job:worker/task:1")
    devices = [setter(name, shape=(3,)) for name in ("a", "b", "c", "d")]
    assert devices == ["/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:0", "/job:ps/task:1"]
    assert setter.worker_device == "/job:worker/task:1"


def test_device_setter_answers_the_same_device_for_a_variable_asked_twice() -> None:
    setter = replica_device_setter(ps_tasks=3)
    first = setter("w", shape=(2,))
    setter("b", shape=(2,))
    assert setter("w", shape=(2,)) == first


def test_greedy_strategy_balances_bytes_across_ps_tasks() -> None:
    shapes = {"big": (1000,), "s1": (10,), "s2": (10,), "s3": (10,)}
    plan = plan_placement(shapes, 2, strategy="greedy")
    names = [[s.name for s in shard.segments] for shard in plan.shards]
    assert names == [["big"], ["s1", "s2", "s3"]]
    round_robin = plan_placement(shapes, 2)
    assert [[s.name for s in shard.segments] for shard in round_robin.shards] == [
        ["big", "s2"], ["s1", "s3"]]


def test_variable_above_threshold_is_partitioned_by_rows_across_ps_tasks() -> None:
    plan = plan_placement({"emb": (5, 4), "b": (4,)}, 2, partition_threshold_bytes=64)
    parts = plan.segments_of("emb")
    assert [(task, seg.shape, seg.start, seg.numel) for task, seg in parts] == [
        (0, (3, 4), 0, 12), (1, (2, 4), 12, 8)]
    assert sum(seg.numel for _, seg in parts) == 20
    assert parts[0][1].label == "emb/part_0_of_2"
    # the small variable stays whole
    assert [seg.numel for _, seg in plan.segments_of("b")] == [4]


def test_segments_are_contiguous_in_each_shard_buffer() -> None:
    plan = plan_placement({"a": (2, 3), "b": (4,), "c": (1,)}, 1)
    shard = plan.shards[0]
    assert [s.offset for s in shard.segments] == [0, 6, 10]
    assert shard.numel == 11 and shard.nbytes == 44
    assert shard.segment_at(0).name == "a" and shard.segment_at(9).name == "b"
    assert shard.segment_at(10).name == "c"


def test_layout_fingerprint_changes_with_shapes() -> None:
    one = plan_placement({"a": (2, 3)}, 1).shards[0]
    same = plan_placement({"a": (2, 3)}, 1).shards[0]
    other = plan_placement({"a": (3, 2)}, 1).shards[0]
    assert one.fingerprint == same.fingerprint != other.fingerprint


def test_no_ps_job_gives_no_setter() -> None:
    assert replica_device_setter(cluster={"worker": ["localhost:1"]}) is None


def test_unknown_strategy_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Unknown ps_strategy 'fastest'.*round_robin"):
        replica_device_setter(ps_tasks=2, ps_strategy="fastest")


def test_custom_chooser_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"put 'w' on task 5.*0\.\.1"):
        plan_placement({"w": (2,)}, 2, strategy=lambda name, nbytes: 5)


def test_duplicate_variable_name_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'w' is placed twice"):
        plan_placement([("w", (2,)), ("w", (3,))], 1)


def test_unplaced_variable_lookup_names_the_placed_ones() -> None:
    plan = plan_placement({"w": (2,)}, 1)
    with pytest.raises(InvalidArgumentError, match=r"'v' is not placed.*placed variables: w"):
        plan.device_of("v")
    assert plan.device_of("w") == "/job:ps/task:0"


def test_setter_call_and_place_agree() -> None:
    setter = replica_device_setter(ps_tasks=2)
    assert setter("b", shape=(4,)) == "/job:ps/task:0"
    plan = setter.place({"w": (4, 4), "b": (4,)})
    assert plan.device_of("b") == setter("b", shape=(4,)) == "/job:ps/task:0"
    assert plan.device_of("w") == setter("w", shape=(4, 4)) == "/job:ps/task:1"
    assert setter.place({"w": (4, 4), "b": (4,)}) == plan


def test_setter_as_a_device_function_puts_variables_on_ps_and_the_rest_on_the_worker() -> None:
    from towerflow.devices import Operation

    setter = replica_device_setter(cluster=CLUSTER, worker_device="/job:worker/task:1")
    assert setter(Operation("weight", "VariableV2", shape=(3,))) == "/job:ps/task:0"
    assert setter(Operation("bias", "VariableV2", shape=(3,))) == "/job:ps/task:1"
    assert setter(Operation("matmul", "matmul")) == "/job:worker/task:1"
    custom = replica_device_setter(cluster=CLUSTER, ps_ops=["matmul"])
    assert custom(Operation("matmul", "matmul")) == "/job:ps/task:0"


def test_a_variable_asked_again_with_another_shape_is_refused() -> None:
    setter = replica_device_setter(ps_tasks=2)
    setter("w", shape=(2,))
    with pytest.raises(InvalidArgumentError, match=r"Variable 'w' was placed with shape \(2,\) "
                                                   r"and is now asked about with shape \(3,\)"):
        setter.place({"w": (3,)})


def test_placement_from_tasks_refuses_a_variable_without_a_task() -> None:
    from towerflow.ps.placement import placement_from_tasks

    with pytest.raises(InvalidArgumentError, match=r"Variable 'b' was given no ps task, and "
                                                   r"the cluster has 2 ps task\(s\); build every"):
        placement_from_tasks({"w": (2,), "b": (2,)}, {"w": 1}, 2)
