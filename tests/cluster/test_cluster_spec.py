"""ClusterSpec and TaskInfo: parsing, queries, and every validation error."""

from __future__ import annotations

import json

import pytest

from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.cluster.spec import is_loopback_host, parse_address
from towerflow.errors import InvalidArgumentError, NotFoundError

ARTICLE_003 = {"ps": ["localhost:1681"], "worker": ["localhost:1682", "localhost:1683"]}


def test_jobs_tasks_and_addresses_of_article_003_cluster():
    spec = ClusterSpec(ARTICLE_003)
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_address("worker", 1) == "localhost:1683"
    assert spec.as_dict() == ARTICLE_003
    assert [(str(t), a) for t, a in spec.tasks()] == [
        ("ps:0", "localhost:1681"), ("worker:0", "localhost:1682"), ("worker:1", "localhost:1683"),
    ]


def test_any_job_name_and_dict_of_index_form():
    spec = ClusterSpec({"local": {1: "localhost:2999", 0: "localhost:2998"}})
    assert spec.job_tasks("local") == ["localhost:2998", "localhost:2999"]
    assert ClusterSpec({"local": ["localhost:2998", "localhost:2999"]}) == spec


def test_cluster_spec_is_an_immutable_hashable_value():
    spec = ClusterSpec(ARTICLE_003)
    with pytest.raises(AttributeError, match="immutable"):
        spec.extra = 1
    copy = ClusterSpec(spec)
    assert copy == spec and hash(copy) == hash(spec)
    assert "worker" in spec and "chief" not in spec


def test_task_info_device_name():
    assert TaskInfo("worker", 1).device_name == "/job:worker/replica:0/task:1"


def test_from_json_file_accepts_plain_and_tf_config_shaped_files(tmp_path):
    plain = tmp_path / "cluster.json"
    plain.write_text(json.dumps(ARTICLE_003))
    wrapped = tmp_path / "tf_config.json"
    wrapped.write_text(json.dumps({"cluster": ARTICLE_003, "task": {"type": "ps", "index": 0}}))
    assert ClusterSpec.from_json_file(plain) == ClusterSpec.from_json_file(wrapped) == ClusterSpec(ARTICLE_003)


def test_from_json_file_errors_name_the_file(tmp_path):
    with pytest.raises(NotFoundError, match="cluster file '.*missing.json' does not exist"):
        ClusterSpec.from_json_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ps: 1")
    with pytest.raises(InvalidArgumentError, match="cluster file '.*bad.json' is not valid JSON"):
        ClusterSpec.from_json_file(bad)


@pytest.mark.parametrize(
    ("cluster", "pattern"),
    [
        ({}, "the cluster has no jobs"),
        ({"worker": []}, "job 'worker' has no tasks"),
        ({"ps": ["localhost:2222"], "worker": ["127.0.0.1:2222"]},
         "address '127.0.0.1:2222' of /job:worker/replica:0/task:0 is also used by /job:ps"),
        ({"worker": ["localhost:2222", "localhost:2222"]}, "also used by /job:worker/replica:0/task:0"),
        ({"worker": [":2222"]}, "address ':2222'.* empty or malformed host"),
        ({"worker": ["localhost"]}, "address 'localhost' of /job:worker/replica:0/task:0 has no numeric port"),
        ({"worker": ["localhost:http"]}, "'localhost:http' of .* has no numeric port"),
        ({"worker": ["localhost:70000"]}, "port 70000, outside 1..65535"),
        ({"worker": ["localhost:0"]}, "port 0, outside 1..65535"),
        ({"worker": ["bad host:22"]}, "empty or malformed host"),
        ({"worker": [2222]}, "address 2222 of .* is not a string"),
        ({"worker": "localhost:2222"}, "single string 'localhost:2222' instead of a list"),
        ({"Worker!": ["localhost:1"]}, "job name 'Worker!' is not valid"),
        ({"chief": ["localhost:1", "localhost:2"]}, "the cluster has 2 chiefs"),
        ({"worker": {0: "localhost:1", 2: "localhost:2"}}, r"task indices \[0, 2\]; indices must be exactly \[0, 1\]"),
        (["localhost:1"], "is not a mapping"),
    ],
)
def test_every_malformed_cluster_is_refused_with_a_clear_message(cluster, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        ClusterSpec(cluster)


def test_unknown_job_and_index_out_of_range():
    spec = ClusterSpec(ARTICLE_003)
    with pytest.raises(InvalidArgumentError, match=r"job 'chief' is not in the cluster, whose jobs are \['ps', 'worker'\]"):
        spec.task_address("chief", 0)
    with pytest.raises(InvalidArgumentError, match="task index 2 is out of range for job 'worker', which has 2"):
        spec.validate_task("worker", 2)
    with pytest.raises(InvalidArgumentError, match="task index -1 is out of range"):
        spec.task_address("ps", -1)


def test_addresses_ipv6_and_scheme():
    assert parse_address("[::1]:2222") == ("::1", 2222)
    assert parse_address("grpc://node01:2223") == ("node01", 2223)
    with pytest.raises(InvalidArgumentError, match="empty or malformed host"):
        parse_address("[zz::1]:2222")
    assert is_loopback_host("::1") and is_loopback_host("127.0.0.5") and not is_loopback_host("node01")


def test_tf_config_round_trips_through_from_tf_config_and_may_name_an_evaluator():
    cluster = ClusterSpec({"ps": ["localhost:2222"], "worker": ["localhost:2223", "localhost:2224"]})
    value = cluster.tf_config(TaskInfo("worker", 1))
    assert ClusterSpec.from_tf_config({"TF_CONFIG": value}) == (cluster, TaskInfo("worker", 1))
    evaluator = json.loads(cluster.tf_config(TaskInfo("evaluator", 0)))
    assert evaluator == {"cluster": cluster.as_dict(), "task": {"type": "evaluator", "index": 0}}


def test_replica_roles_count_the_chief_first() -> None:
    spec = ClusterSpec({"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]})
    assert spec.replicas == (TaskInfo("chief", 0), TaskInfo("worker", 0), TaskInfo("worker", 1))
    assert spec.num_replicas == 3 and spec.chief == TaskInfo("chief", 0)
    assert spec.replica_index(TaskInfo("chief", 0)) == 0
    assert spec.replica_index(TaskInfo("worker", 1)) == 2
    assert not spec.is_chief(TaskInfo("worker", 0))
    with pytest.raises(InvalidArgumentError, match=r"task ps:0 does not train .* chief:0, worker:0"):
        spec.replica_index(TaskInfo("ps", 0))


def test_without_a_chief_job_worker_0_is_chief_and_a_local_job_trains() -> None:
    spec = ClusterSpec({"ps": ["h:1"], "worker": ["h:2", "h:3"]})
    assert spec.chief == TaskInfo("worker", 0) and spec.replica_index(TaskInfo("worker", 1)) == 1
    local = ClusterSpec({"local": ["h:1", "h:2"]})
    assert local.num_replicas == 2 and local.is_chief(TaskInfo("local", 0))
    only_ps = ClusterSpec({"ps": ["h:1"]})
    assert only_ps.num_replicas == 0 and only_ps.chief is None


def test_a_master_job_is_the_chief_as_in_tensorflow() -> None:
    spec = ClusterSpec({"master": ["m:1"], "ps": ["p:1"], "worker": ["w:1", "w:2"]})
    assert spec.replicas == (TaskInfo("master", 0), TaskInfo("worker", 0), TaskInfo("worker", 1))
    assert spec.num_replicas == 3 and spec.chief == TaskInfo("master", 0)
    assert spec.is_chief(TaskInfo("master", 0)) and not spec.is_chief(TaskInfo("worker", 0))
    assert spec.replica_index(TaskInfo("master", 0)) == 0
    assert spec.replica_index(TaskInfo("worker", 1)) == 2


@pytest.mark.parametrize(
    ("cluster", "pattern"),
    [
        ({"chief": ["h:1"], "master": ["h:2"], "worker": ["h:3"]},
         r"both a 'chief' job \['h:1'\] and a 'master' job \['h:2'\].*keep one"),
        ({"master": ["h:1", "h:2"]}, r"the cluster has 2 chiefs \['h:1', 'h:2'\] in job 'master'"),
    ],
)
def test_a_second_chief_under_either_name_is_refused(cluster, pattern) -> None:
    with pytest.raises(InvalidArgumentError, match=pattern):
        ClusterSpec(cluster)
