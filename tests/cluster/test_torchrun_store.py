"""torchrun across nodes: each rank's address comes from torchrun's rendezvous store.

A real ``TCPStore`` hosted here plays torchrun's agent store; the other rank's
address is published in it as that rank would, and this process resolves as
rank 0 of a two-node job.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.cluster import TaskInfo, resolve_cluster
from towerflow.cluster.rendezvous import address_key, exchange_addresses
from towerflow.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError


@pytest.fixture
def store(free_ports):
    """A TCPStore on loopback, as torchrun's agent hosts one for its workers."""
    port = free_ports(1)[0]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server


def _env(store: dist.TCPStore, **extra: str) -> dict[str, str]:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7",
           "TORCHELASTIC_RESTART_COUNT": "0", "TOWERFLOW_PORT": "6000",
           "TOWERFLOW_RENDEZVOUS_TIMEOUT": "5"}
    env.update(extra)
    return env


def test_two_nodes_resolve_from_the_store_without_towerflow_hosts(store) -> None:
    env = _env(store)
    store.set(address_key(env, 1), "127.0.0.1:7001")  # node 1's rank, as it publishes itself
    spec, task = resolve_cluster(env=env)
    assert spec.as_dict() == {"worker": ["127.0.0.1:6000", "127.0.0.1:7001"]}
    assert task == TaskInfo("worker", 0)
    assert store.get("towerflow/job7/restart0/address/0") == b"127.0.0.1:6000"


def test_the_first_ranks_become_ps_tasks_with_the_store_addresses(store) -> None:
    env = _env(store, RANK="1", GROUP_RANK="1", TOWERFLOW_NUM_PS="1")
    store.set(address_key(env, 0), "127.0.0.1:7000")
    spec, task = resolve_cluster(env=env)
    assert spec.as_dict() == {"ps": ["127.0.0.1:7000"], "worker": ["127.0.0.1:6000"]}
    assert task == TaskInfo("worker", 0)


def test_a_rank_missing_from_the_store_is_named_after_the_bounded_wait(store) -> None:
    env = _env(store, TOWERFLOW_RENDEZVOUS_TIMEOUT="0.5")
    # rank 1 published during the previous restart only: it is not this restart's address
    store.set(address_key(dict(env, TORCHELASTIC_RESTART_COUNT="0"), 1), "127.0.0.1:7001")
    env["TORCHELASTIC_RESTART_COUNT"] = "1"
    with pytest.raises(DeadlineExceededError,
                       match=r"rank\(s\) \[1\] of 2 published no address in torchrun's "
                             r"rendezvous store at 127\.0\.0\.1:\d+ .*within 0\.5 s"):
        resolve_cluster(env=env)


def test_towerflow_hosts_that_agree_with_the_store_give_their_names(store) -> None:
    env = _env(store, TOWERFLOW_HOSTS="localhost,localhost")
    store.set(address_key(env, 1), "127.0.0.1:7001")
    spec, _ = resolve_cluster(env=env)
    assert spec.as_dict() == {"worker": ["localhost:6000", "localhost:7001"]}


def test_towerflow_hosts_that_disagree_with_the_store_are_refused(store) -> None:
    env = _env(store, TOWERFLOW_HOSTS="127.0.0.1,192.0.2.7")
    store.set(address_key(env, 1), "127.0.0.1:7001")
    with pytest.raises(InvalidArgumentError,
                       match=r"TOWERFLOW_HOSTS names '192\.0\.2\.7' for node 1, but rank 1 "
                             r"published 127\.0\.0\.1:7001 in torchrun's rendezvous store; "
                             r"unset TOWERFLOW_HOSTS"):
        resolve_cluster(env=env)
    with pytest.raises(InvalidArgumentError, match=r"names 1 host\(s\) \['127\.0\.0\.1'\] but "
                                                   r"torchrun runs 2 nodes"):
        resolve_cluster(env=dict(env, TOWERFLOW_HOSTS="127.0.0.1"))


def test_a_node_reaching_the_store_over_loopback_among_other_hosts_is_refused(store) -> None:
    env = _env(store)
    store.set(address_key(env, 1), "192.0.2.7:7001")
    with pytest.raises(InvalidArgumentError,
                       match=r"rank 0 reaches torchrun's rendezvous store from the loopback "
                             r"address 127\.0\.0\.1.*--local-addr"):
        resolve_cluster(env=env)


def test_a_store_that_does_not_answer_is_unavailable(free_ports) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    with pytest.raises(UnavailableError, match=r"torchrun's rendezvous store at 127\.0\.0\.1:\d+ "
                                               r"does not answer"):
        exchange_addresses(env, 0, 2, "127.0.0.1:6000", timeout_s=0.5)


def test_hand_set_variables_across_nodes_still_need_towerflow_hosts() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29500"}
    with pytest.raises(InvalidArgumentError, match=r"no torchrun rendezvous store is there to "
                                                   r"ask .*start the ranks with torchrun"):
        resolve_cluster(env=env)
    spec, _ = resolve_cluster(env=dict(env, TOWERFLOW_HOSTS="n0,n1"))
    assert spec.as_dict() == {"worker": ["n0:29501", "n1:29501"]}


def test_bad_rendezvous_timeout_is_refused(store) -> None:
    with pytest.raises(InvalidArgumentError, match="TOWERFLOW_RENDEZVOUS_TIMEOUT='soon' is not"):
        resolve_cluster(env=_env(store, TOWERFLOW_RENDEZVOUS_TIMEOUT="soon"))


def test_with_a_secret_an_address_written_without_it_is_refused(store) -> None:
    from towerflow.cluster.rendezvous import sign_entry
    from towerflow.errors import UnauthenticatedError

    env = _env(store, TOWERFLOW_SECRET="cluster-secret")
    key = address_key(env, 1)
    store.set(key, "127.0.0.1:6666")  # a rogue address, written by whoever reaches the store
    with pytest.raises(UnauthenticatedError,
                       match=r"the address '127\.0\.0\.1:6666' under towerflow/job7/restart0/"
                             r"address/1 in torchrun's rendezvous store at .* is not signed with "
                             r"this cluster's secret"):
        resolve_cluster(env=env)
    # signed with another secret, or a signed entry of another rank copied here: refused too
    for forged in (sign_entry(b"other", key, "127.0.0.1:6666"),
                   sign_entry(b"cluster-secret", address_key(env, 0), "127.0.0.1:6666")):
        store.set(key, forged)
        with pytest.raises(UnauthenticatedError, match="not signed with this cluster's secret"):
            resolve_cluster(env=env)
    store.set(key, sign_entry(b"cluster-secret", key, "127.0.0.1:7001"))
    spec, _ = resolve_cluster(env=env)
    assert spec.as_dict() == {"worker": ["127.0.0.1:6000", "127.0.0.1:7001"]}
    assert store.get(address_key(env, 0)).startswith(b"127.0.0.1:6000 ")


@settings(max_examples=60, deadline=None)
@given(value=st.text(max_size=200))
def test_no_unsigned_store_value_passes_the_check(value: str) -> None:
    from towerflow.cluster.rendezvous import open_entry
    from towerflow.errors import UnauthenticatedError

    with pytest.raises(UnauthenticatedError, match="not signed"):
        open_entry(b"k", "towerflow/r/restart0/address/0", value)


def test_without_a_secret_the_store_says_its_addresses_are_unauthenticated(store, caplog) -> None:
    env = _env(store)
    store.set(address_key(env, 1), "127.0.0.1:7001")
    with caplog.at_level("WARNING", logger="towerflow.cluster"):
        resolve_cluster(env=env)
    assert "cannot be authenticated without a cluster secret" in caplog.text
