"""choose_strategy: one road from explicit arguments and the environment to a strategy."""

from __future__ import annotations

import json

import pytest

from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.errors import InvalidArgumentError
from towerflow.strategies.choose import choose_kind, choose_strategy
from towerflow.strategies.single import SingleDevice


def _tf_config(cluster: dict, job: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}


PS_CLUSTER = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]}


def test_no_cluster_trains_on_one_device() -> None:
    strategy = choose_strategy(env={}, device="cpu")
    assert isinstance(strategy, SingleDevice) and str(strategy.device) == "cpu"


def test_a_bare_tf_config_with_a_ps_job_trains_through_the_ps_everywhere(monkeypatch) -> None:
    env = _tf_config(PS_CLUSTER, "worker", 1)
    strategy = choose_strategy(env=env, mode="sync")
    try:
        assert strategy.name == "ps" and strategy.rank == 1 and not strategy.is_chief
        assert strategy.aggregation.mode == "sync"
    finally:
        strategy.shutdown()
    from towerflow.training.loop import default_strategy

    monkeypatch.setenv("TF_CONFIG", env["TF_CONFIG"])
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    trainer_strategy = default_strategy()
    try:
        assert trainer_strategy.name == "ps" and trainer_strategy.rank == 1
    finally:
        trainer_strategy.shutdown()


def test_roles_come_from_the_cluster_spec() -> None:
    two = {"chief": ["h:1"], "worker": ["h:2"]}
    assert choose_kind(ClusterSpec(two), TaskInfo("worker", 0)) == "mirrored"
    assert choose_kind(ClusterSpec({"worker": ["h:1"]}), TaskInfo("worker", 0)) == "single"
    assert choose_kind(None, None) == "single"
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    from towerflow.cluster import resolve_cluster

    assert choose_kind(*resolve_cluster(env=env)) == "mirrored"


def test_a_task_that_does_not_train_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"task ps:0 does not train in this cluster"):
        choose_strategy(env=_tf_config(PS_CLUSTER, "ps", 0))


def test_an_option_of_another_strategy_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"mode='sync' do not apply: this program "
                                                   r"trains with SingleDevice \(no cluster\)"):
        choose_strategy(env={}, mode="sync")
    with pytest.raises(InvalidArgumentError, match=r"Unknown strategy 'tpu'"):
        choose_strategy("tpu", env={})


def test_a_ready_strategy_is_used_as_it_is() -> None:
    mine = SingleDevice("cpu")
    assert choose_strategy(mine) is mine
    with pytest.raises(InvalidArgumentError, match=r"given ready-made"):
        choose_strategy(mine, mode="sync")


def test_an_explicit_cluster_wins_over_the_environment() -> None:
    env = _tf_config({"worker": ["127.0.0.1:2225"]}, "worker", 0)
    strategy = choose_strategy(cluster=PS_CLUSTER, task=TaskInfo("worker", 0), env=env)
    try:
        assert strategy.name == "ps" and strategy.is_chief
    finally:
        strategy.shutdown()
