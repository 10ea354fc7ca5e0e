"""Resolving the cluster and the task: explicit, TF_CONFIG (Kubeflow), torchrun, Slurm."""

from __future__ import annotations

import json

import pytest

from towerflow.cluster import ClusterSpec, TaskInfo, is_chief, resolve_cluster
from towerflow.cluster.resolvers import expand_nodelist, expand_tasks_per_node
from towerflow.errors import InvalidArgumentError, NotFoundError

CLUSTER = {"chief": ["c0:2222"], "ps": ["p0:2222", "p1:2222"], "worker": ["w0:2222", "w1:2222"]}


def tf_config(task_type: str, index: int, cluster: dict = CLUSTER) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}


def test_tf_config_of_a_kubeflow_tfjob_worker():
    spec, task = resolve_cluster(env=tf_config("worker", 1))
    assert spec == ClusterSpec(CLUSTER)
    assert task == TaskInfo("worker", 1)
    assert ClusterSpec.from_tf_config(tf_config("ps", 0)) == (spec, TaskInfo("ps", 0))


def test_tf_config_evaluator_outside_the_cluster_is_accepted():
    spec, task = resolve_cluster(env=tf_config("evaluator", 0))
    assert task == TaskInfo("evaluator", 0) and "evaluator" not in spec


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        (tf_config("master", 0), "TF_CONFIG task type 'master' is not a job of its cluster"),
        (tf_config("worker", 2), "task index 2 is out of range for job 'worker'"),
        ({"TF_CONFIG": "{cluster"}, "TF_CONFIG is not valid JSON"),
        ({"TF_CONFIG": '{"task": {"type": "worker"}}'}, 'TF_CONFIG has no "cluster"'),
        ({"TF_CONFIG": json.dumps({"cluster": CLUSTER})}, 'TF_CONFIG task {} has no "type"'),
        ({"TF_CONFIG": json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": "0"}})},
         "TF_CONFIG task index '0' is not an integer"),
        (tf_config("worker", 0, {"worker": ["w0:2222", "w0:2222"]}), "also used by"),
    ],
)
def test_malformed_tf_config_fails_before_anything_starts(env, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        resolve_cluster(env=env)


def test_from_tf_config_without_tf_config_says_how_to_set_it():
    with pytest.raises(NotFoundError, match="TF_CONFIG is not set"):
        ClusterSpec.from_tf_config({})


def test_no_cluster_anywhere_is_a_single_process():
    assert resolve_cluster(env={}) == (None, None)
    assert resolve_cluster(env={"TF_CONFIG": "{}"}) == (None, None)


def test_explicit_arguments_win_over_the_environment(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ps": ["localhost:1681"], "worker": ["localhost:1682"]}))
    spec, task = resolve_cluster(str(path), "ps", 0, env=tf_config("worker", 1))
    assert spec.jobs == ["ps", "worker"] and task == TaskInfo("ps", 0)
    spec, task = resolve_cluster(None, None, 0, env=tf_config("worker", 1))
    assert task == TaskInfo("worker", 0)
    with pytest.raises(InvalidArgumentError, match="task index 3 is out of range for job 'ps'"):
        resolve_cluster(CLUSTER, "ps", 3, env={})
    with pytest.raises(InvalidArgumentError, match="no cluster; pass --cluster or set TF_CONFIG"):
        resolve_cluster(None, "ps", 0, env={})


def test_torchrun_single_node_ranks_become_workers_next_to_master_port():
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    spec, task = resolve_cluster(env=env)
    assert spec.as_dict() == {"worker": ["127.0.0.1:29501", "127.0.0.1:29502", "127.0.0.1:29503"]}
    assert task == TaskInfo("worker", 2)


def test_torchrun_multi_node_with_ps_uses_towerflow_hosts_and_port():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29500", "TOWERFLOW_HOSTS": "n0,n1", "TOWERFLOW_PORT": "4000",
           "TOWERFLOW_NUM_PS": "1"}  # fmt: skip
    spec, task = resolve_cluster(env=env)
    assert spec.as_dict() == {"ps": ["n0:4000"], "worker": ["n0:4001", "n1:4000", "n1:4001"]}
    assert task == TaskInfo("worker", 2)
    env.pop("TOWERFLOW_HOSTS")
    with pytest.raises(InvalidArgumentError, match="on 2 nodes but TOWERFLOW_HOSTS names 0 host"):
        resolve_cluster(env=env)
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE='x' is not an integer"):
        resolve_cluster(env={"RANK": "0", "WORLD_SIZE": "x"})


def test_slurm_nodelist_expansion():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("a[1-2]-ib[0-1],login") == ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1", "login"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(InvalidArgumentError, match="unbalanced brackets"):
        expand_nodelist("node[01-03")
    with pytest.raises(InvalidArgumentError, match="descending range '5-3'"):
        expand_nodelist("node[5-3]")
    with pytest.raises(InvalidArgumentError, match="has part 'x2'"):
        expand_tasks_per_node("x2")


def test_slurm_tasks_first_num_ps_are_ps_rest_workers():
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_JOB_NODELIST": "other[1-9]",
           "SLURM_STEP_NODELIST": "gpu[01-02],cpu7", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
           "TOWERFLOW_NUM_PS": "1", "TOWERFLOW_PORT": "3000"}  # fmt: skip
    spec, task = resolve_cluster(env=env)
    assert spec.as_dict() == {
        "ps": ["gpu01:3000"],
        "worker": ["gpu01:3001", "gpu02:3000", "gpu02:3001", "cpu7:3000"],
    }
    assert task == TaskInfo("worker", 3)
    env["TOWERFLOW_NUM_PS"] = "5"
    with pytest.raises(InvalidArgumentError, match="TOWERFLOW_NUM_PS=5 leaves no worker among the 5 Slurm"):
        resolve_cluster(env=env)
    with pytest.raises(InvalidArgumentError, match=r"tasks per node \[2, 2, 1\] do not match"):
        resolve_cluster(env={**env, "TOWERFLOW_NUM_PS": "0", "SLURM_NTASKS": "6",
                             "SLURM_STEP_NUM_TASKS": "6"})  # fmt: skip


def test_slurm_without_tasks_per_node_splits_evenly_with_default_port():
    spec, task = resolve_cluster(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert spec.as_dict() == {"worker": ["n1:2222", "n2:2222"]} and task == TaskInfo("worker", 0)


def test_tf_config_wins_over_torchrun_and_slurm():
    env = {**tf_config("ps", 1), "RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "0"}
    assert resolve_cluster(env=env)[1] == TaskInfo("ps", 1)


def test_is_chief_follows_tensorflow():
    spec = ClusterSpec(CLUSTER)
    assert is_chief(spec, TaskInfo("chief", 0))
    assert not is_chief(spec, TaskInfo("worker", 0))
    no_chief = ClusterSpec({"ps": ["p:1"], "worker": ["w:1", "w:2"]})
    assert is_chief(no_chief, TaskInfo("worker", 0)) and not is_chief(no_chief, TaskInfo("ps", 0))
    local = ClusterSpec({"local": ["localhost:2998", "localhost:2999"]})
    assert is_chief(local, TaskInfo("local", 0)) and not is_chief(local, TaskInfo("local", 1))


def test_tf_config_of_a_kubeflow_tfjob_master_makes_it_the_training_chief():
    cluster = {"master": ["m:1"], "ps": ["p:1"], "worker": ["w:1"]}
    spec, task = resolve_cluster(env=tf_config("master", 0, cluster))
    assert task == TaskInfo("master", 0)
    assert is_chief(spec, task) and task in spec.replicas
    assert spec.replicas == (TaskInfo("master", 0), TaskInfo("worker", 0))
    assert not is_chief(spec, TaskInfo("worker", 0))


def test_a_ps_task_of_a_tfjob_with_a_master_counts_and_names_the_master_as_replica_0():
    from types import SimpleNamespace

    from towerflow.cluster import ServerOptions
    from towerflow.ps import ShardHost
    from towerflow.ps.server.dense.service import replica_task

    spec, _ = resolve_cluster(env=tf_config("ps", 0, {"master": ["m:1"], "ps": ["p:1"], "worker": ["w:1"]}))
    assert [replica_task(spec, r) for r in range(3)] == [TaskInfo("master", 0), TaskInfo("worker", 0), None]
    server = SimpleNamespace(cluster=spec, task=TaskInfo("ps", 0), options=ServerOptions())
    assert ShardHost(server).service.replicas == 2


def slurm_env(procid: int, localid: int, node: str, distribution: str | None, **more: str) -> dict[str, str]:
    env = {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURMD_NODENAME": node,
           "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "SLURM_NTASKS": "4", **more}  # fmt: skip
    if distribution is not None:
        env["SLURM_DISTRIBUTION"] = distribution
    return env


@pytest.mark.parametrize("distribution", ["cyclic", "cyclic:block", "cyclic:cyclic,pack", "CYCLIC:fcyclic"])
def test_slurm_cyclic_distribution_puts_consecutive_tasks_on_consecutive_nodes(distribution):
    spec, task = resolve_cluster(env=slurm_env(1, 0, "node02", distribution))
    assert spec.as_dict() == {"worker": ["node01:2222", "node02:2222", "node01:2223", "node02:2223"]}
    assert task == TaskInfo("worker", 1) and spec.task_address("worker", 1) == "node02:2222"


@pytest.mark.parametrize("distribution", [None, "block", "block:cyclic", "*:cyclic", "block,nopack"])
def test_slurm_block_distribution_and_the_default_fill_each_node_in_turn(distribution):
    spec, task = resolve_cluster(env=slurm_env(1, 1, "node01", distribution))
    assert spec.as_dict() == {"worker": ["node01:2222", "node01:2223", "node02:2222", "node02:2223"]}
    assert task == TaskInfo("worker", 1)


def test_slurm_cyclic_with_uneven_counts_and_plane_distribution():
    uneven = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NTASKS": "4"}
    spec, _ = resolve_cluster(env={**slurm_env(3, 2, "n1", "cyclic"), **uneven})
    assert spec.job_tasks("worker") == ["n1:2222", "n2:2222", "n1:2223", "n1:2224"]
    plane = {"SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "3(x2),2",
             "SLURM_NTASKS": "8", "SLURM_DIST_PLANESIZE": "2"}  # fmt: skip
    spec, task = resolve_cluster(env={**slurm_env(7, 2, "n2", "plane"), **plane})
    assert spec.job_tasks("worker") == ["n1:2222", "n1:2223", "n2:2222", "n2:2223", "n3:2222",
                                         "n3:2223", "n1:2224", "n2:2224"]  # fmt: skip
    assert task == TaskInfo("worker", 7)
    spec2, _ = resolve_cluster(env={**slurm_env(7, 2, "n2", "plane=2"), **plane,
                                    "SLURM_DIST_PLANESIZE": ""})  # fmt: skip
    assert spec2 == spec


def test_slurm_task_on_another_node_than_the_layout_says_is_refused_naming_both():
    with pytest.raises(InvalidArgumentError, match=(
            r"Slurm task 1 runs on node02 \(SLURMD_NODENAME\) as its local task 0 "
            r"\(SLURM_LOCALID\), but SLURM_DISTRIBUTION=block.* puts it on node01 as local "
            r"task 1.*srun --distribution=block")):
        resolve_cluster(env=slurm_env(1, 0, "node02", "block"))
    with pytest.raises(InvalidArgumentError, match=r"runs on node01 .* as its local task 0 .* on node01 as local task 1"):
        resolve_cluster(env=slurm_env(1, 0, "node01", None))
    topology = slurm_env(1, 0, "", "block", SLURM_TOPOLOGY_ADDR="s0.node02",
                         SLURM_TOPOLOGY_ADDR_PATTERN="switch.node")  # fmt: skip
    del topology["SLURMD_NODENAME"]
    with pytest.raises(InvalidArgumentError, match=r"runs on node02 \(SLURM_TOPOLOGY_ADDR\)"):
        resolve_cluster(env=topology)


@pytest.mark.parametrize("distribution", ["arbitrary", "spread", "plane"])
def test_slurm_distribution_it_cannot_lay_out_is_refused_with_the_way_out(distribution):
    with pytest.raises(InvalidArgumentError, match=(
            rf"SLURM_DISTRIBUTION={distribution}\b.*cannot.*srun --distribution=block")):
        resolve_cluster(env=slurm_env(1, 0, "node02", distribution))
