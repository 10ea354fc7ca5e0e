"""towerflow.DynamicEmbedding: in one process, and on real ps tasks (127.0.0.1, gRPC)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import towerflow
from towerflow.checkpoint import CheckpointManager
from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps.partition import HashPartitioner
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.observe import ClusterObserver
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.dynamic import DynamicEmbedding as ClusterDynamicEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.training.session import checkpoint_metadata, restore_latest

SECRET = Credentials(secret=b"dynamic-secret")
INIT = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 11}
EXTREMES = torch.tensor([-2**63, -1, 0, 2**63 - 1])
#: raw 64-bit ids: a fixed random pool the batches draw from
POOL = torch.randint(-2**63, 2**63 - 1, (60,), generator=torch.Generator().manual_seed(4),
                     dtype=torch.int64)


def rows_of(ids: torch.Tensor) -> torch.Tensor:
    return UniformRows(**{k: v for k, v in INIT.items() if k != "kind"})(ids, 3, torch.float32)


# ----------------------------------------------------------------------------- one process
def test_top_level_exports_both_embedding_modules():
    assert issubclass(towerflow.DynamicEmbedding, towerflow.ShardedEmbedding)
    assert {"DynamicEmbedding", "ShardedEmbedding"} <= set(towerflow.__all__)


def test_one_process_extreme_ids_first_touch_and_not_stored_lookups():
    emb = towerflow.DynamicEmbedding(3, initializer=INIT, name="e")
    out = emb(EXTREMES.view(2, 2))
    assert out.shape == (2, 2, 3)
    assert torch.equal(out.view(4, 3), rows_of(EXTREMES))
    assert emb.stats()["rows"] == 0  # looked up, not stored
    out.sum().backward()
    emb.apply_updates(lr=0.25)
    stats = emb.stats()
    assert (stats["rows"], stats["admitted"], stats["evicted"]) == (4, 4, 0)
    assert stats["bytes"] > 0
    assert torch.allclose(emb(EXTREMES), rows_of(EXTREMES) - 0.25)


def test_one_process_bags_match_embedding_bag_over_the_rows():
    emb = towerflow.DynamicEmbedding(3, mode="sum", initializer=INIT)
    ids = torch.tensor([5, -9, 5, 2**40, 7])
    offsets = torch.tensor([0, 2])
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0, -1.0])
    got = emb(ids, offsets, per_sample_weights=weights)
    want = F.embedding_bag(torch.arange(5), rows_of(ids), offsets, mode="sum",
                           per_sample_weights=weights)
    assert torch.allclose(got, want)
    mean = towerflow.DynamicEmbedding(3, mode="mean", initializer=INIT)
    assert torch.allclose(mean(ids.view(1, 5)), rows_of(ids).mean(0, keepdim=True))


def test_one_process_admission_and_eviction_by_capacity():
    emb = towerflow.DynamicEmbedding(3, initializer=INIT, admit_after=2, capacity=40)
    for step in range(1, 31):
        ids = torch.arange(step * 4, step * 4 + 4).repeat(2)  # each id twice in one batch
        emb(ids).sum().backward()
        emb.apply_updates(lr=0.1)  # one push: the id seen once
        emb(ids[:4]).sum().backward()
        emb.apply_updates(lr=0.1)  # its second push: admitted
    stats = emb.stats()
    assert stats["filtered"] == 120 and stats["admitted"] == 120
    assert stats["rows"] <= 40 and stats["evicted"] == 120 - stats["rows"]


def test_float_ids_are_refused_and_int32_ids_widened():
    emb = towerflow.DynamicEmbedding(3, initializer=INIT)
    with pytest.raises(InvalidArgumentError, match="int64 ids .*got torch.float32"):
        emb(torch.tensor([1.0, 2.0]))
    assert torch.equal(emb(torch.tensor([7, -3], dtype=torch.int32)),
                       rows_of(torch.tensor([7, -3])))


@pytest.mark.parametrize("kwargs, pattern", [({"capacity": 0}, "capacity=0"),
                                             ({"admit_after": 0}, "admit_after=0"),
                                             ({"partitioner": "range"}, "partitioner='range'")])
def test_bad_options_are_refused_at_construction(kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        towerflow.DynamicEmbedding(3, **kwargs)


def test_one_process_nan_gradients_are_refused_with_nothing_applied():
    emb = towerflow.DynamicEmbedding(3, initializer=INIT)
    ids = torch.tensor([1, 2])
    (emb(ids) * torch.tensor([[1.0], [float("nan")]])).sum().backward()
    with pytest.raises(InvalidArgumentError, match="of id 2 holds .*nothing was applied"):
        emb.apply_updates(lr=0.1)
    assert emb.stats()["rows"] == 0
    assert torch.equal(emb(ids), rows_of(ids))


def test_the_cluster_module_alone_refuses_to_run_unbound():
    with pytest.raises(FailedPreconditionError, match="use towerflow.DynamicEmbedding"):
        ClusterDynamicEmbedding(3)(torch.tensor([1]))


# ----------------------------------------------------------------------------- ps tasks
@pytest.fixture
def ps_tasks(table_ps_tasks):
    """Two ps tasks serving the table service; ``clients(count, aggregation=None)``."""
    return table_ps_tasks(SECRET)


def dynamic(admit_after: int = 1, **options) -> TableConfig:
    return TableConfig("d", HashPartitioner(2), 3, {"name": "sgd", "hyper": {}}, INIT,
                       store={"kind": "dynamic", "admit_after": admit_after,
                              "evict_after_steps": None, "capacity": None, **options})


def rows_held(client: TableClient, config: TableConfig) -> int:
    return sum(client.status(config, s).rows for s in range(2))


def test_two_workers_read_the_same_unstored_rows_and_first_touch_makes_them(ps_tasks):
    _, clients = ps_tasks
    a, b = clients(2)
    config = dynamic()
    a.init_table(config)
    assert torch.equal(a.pull(config, EXTREMES), rows_of(EXTREMES))
    assert torch.equal(b.pull(config, EXTREMES), a.pull(config, EXTREMES))
    assert rows_held(a, config) == 0
    a.push(config, EXTREMES, torch.ones(4, 3), lr=0.5, step=1)
    assert rows_held(b, config) == 4
    assert torch.allclose(b.pull(config, EXTREMES), rows_of(EXTREMES) - 0.5)


def test_admission_counts_pushes_over_both_workers(ps_tasks):
    _, clients = ps_tasks
    a, b = clients(2)
    config = dynamic(admit_after=2)
    a.init_table(config)
    ids = torch.tensor([123456789012345, -42])
    a.push(config, ids, torch.ones(2, 3), lr=1.0, step=1)
    assert rows_held(a, config) == 0  # seen once: dropped
    assert torch.equal(b.pull(config, ids), rows_of(ids))
    b.push(config, ids, torch.ones(2, 3), lr=1.0, step=2)  # seen by the second worker: admitted
    assert rows_held(a, config) == 2
    assert torch.allclose(a.pull(config, ids), rows_of(ids) - 1.0)
    filtered = sum(a.status(config, s).filtered for s in range(2))
    assert filtered == 2


def raw_push(spec: ClusterSpec, config: TableConfig, row: int, seq: int) -> tpb.PushRowsReply:
    shard = int(config.partitioner.shard_of(torch.tensor([row]))[0])
    request = tpb.PushRowsRequest(
        table=config.name, shard=shard, worker_id=9, incarnation=1, seq=seq, lr=0.5, step=1,
        num_ids=1, dtype="float32", ids=torch.tensor([row]).numpy().tobytes(),
        grads=torch.ones(1, config.dim).numpy().tobytes())
    channel = make_channel(spec.task_address("ps", shard), SECRET)
    try:
        return tpb.PushRowsReply.FromString(unary(
            channel, "/towerflow.ps.Tables/PushRows", request.SerializeToString(), timeout=10))
    finally:
        channel.close()


def test_a_retried_push_applies_once_and_counts_once_for_admission(ps_tasks):
    spec, clients = ps_tasks
    (client,) = clients(1)
    config = dynamic(admit_after=2)
    client.init_table(config)
    row = -(2**62) - 7
    assert raw_push(spec, config, row, seq=1).status == "applied"
    retry = raw_push(spec, config, row, seq=1)
    assert retry.duplicate  # answered, not counted a second time
    assert rows_held(client, config) == 0
    assert raw_push(spec, config, row, seq=2).duplicate is False  # the second push admits
    assert raw_push(spec, config, row, seq=2).duplicate
    assert torch.allclose(client.pull(config, torch.tensor([row])),
                          rows_of(torch.tensor([row])) - 0.5)


def test_nan_gradients_pushed_to_a_ps_are_refused_with_nothing_applied(ps_tasks):
    _, clients = ps_tasks
    (client,) = clients(1)
    config = dynamic()
    client.init_table(config)
    grads = torch.ones(2, 3)
    grads[1, 1] = float("inf")
    candidates = torch.arange(20)
    ids = candidates[config.partitioner.shard_of(candidates) == 0][:2]  # one shard's push
    with pytest.raises(InvalidArgumentError, match="not finite; nothing was applied"):
        client.push(config, ids, grads, lr=0.1, step=1)
    assert rows_held(client, config) == 0


# ----------------------------------------------------------------------------- the strategy
class Click(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.emb = towerflow.DynamicEmbedding(3, mode="sum", initializer=INIT, name="emb",
                                              **options)
        self.out = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return F.binary_cross_entropy_with_logits(model(ids), labels)


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return POOL[torch.randint(0, POOL.numel(), (8, 3), generator=gen)], \
        torch.randint(0, 2, (8,), generator=gen).float()


class Cluster:
    """``num_ps`` ps tasks and one worker (the chief) training ``model`` on them."""

    def __init__(self, free_ports, num_ps: int, model: nn.Module, mode: str = "async") -> None:
        ports = free_ports(num_ps + 1)
        self.spec = ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:-1]],
                                 "worker": [f"127.0.0.1:{ports[-1]}"]})
        self.servers = [Server(self.spec, "ps", i, credentials=SECRET) for i in range(num_ps)]
        self.strategy = ParameterServer(self.spec, TaskInfo("worker", 0), mode,
                                        credentials=SECRET, device="cpu", server=False,
                                        table_part_bytes=300)
        self.model = model
        self.strategy.prepare(model, OptimizerConfig("sgd", lr=0.2))

    def train(self, steps: int, seed: int = 0) -> int:
        for i in range(steps):
            step = self.strategy.run_step(loss_fn, batch(seed + i)).global_step
        return step

    def save(self, manager: CheckpointManager):
        groups = self.strategy.state_dict()
        metadata = checkpoint_metadata(self.strategy)
        return manager.save(metadata["step"], groups, metadata)

    def close(self) -> None:
        try:
            self.strategy.shutdown()
        finally:
            for server in self.servers:
                server.stop()


def test_one_process_mode_equals_the_ps_mode_on_the_same_stream(free_ports):
    torch.manual_seed(0)
    local = Click(admit_after=2, capacity=30)
    remote = copy.deepcopy(local)
    dense = torch.optim.SGD(local.out.parameters(), lr=0.2)
    for i in range(6):
        dense.zero_grad()
        loss_fn(local, batch(i)).backward()
        dense.step()
        local.emb.apply_updates(lr=0.2)
    cluster = Cluster(free_ports, 1, remote, mode="sync")
    try:
        assert cluster.train(6) == 6
        assert cluster.model.emb.stats() == {**local.emb.stats(),
                                             "bytes": cluster.model.emb.stats()["bytes"]}
        with torch.no_grad():
            assert torch.allclose(cluster.model.emb(POOL.view(-1, 1)), local.emb(POOL.view(-1, 1)), atol=1e-6)
        assert torch.allclose(cluster.model.out.weight, local.out.weight, atol=1e-6)
    finally:
        cluster.close()


@pytest.mark.slow
@pytest.mark.parametrize("old, new", [(2, 1), (1, 3)])
def test_a_checkpoint_restores_onto_another_number_of_ps_tasks(free_ports, tmp_path, old, new):
    manager = CheckpointManager(tmp_path / "run", max_to_keep=None)
    cluster = Cluster(free_ports, old, Click(evict_after_steps=50))
    try:
        cluster.train(4)
        with torch.no_grad():
            want = cluster.model.emb(POOL.view(-1, 1))
        stats = cluster.model.emb.stats()
        cluster.save(manager)
    finally:
        cluster.close()
    assert stats["rows"] > 10
    restored = Cluster(free_ports, new, Click(evict_after_steps=50))
    try:
        assert restore_latest(manager, restored.strategy).step == 4
        assert restored.strategy.global_step == 4  # (restores the tables onto the ps tasks)
        with torch.no_grad():  # every stored id answers as before
            assert torch.equal(restored.model.emb(POOL.view(-1, 1)), want)
        got = restored.model.emb.stats()
        assert got["rows"] == stats["rows"]
        shards = [restored.strategy._tables.client.status(restored.model.emb.config, s).rows
                  for s in range(new)]
        assert sum(shards) == stats["rows"] and (new == 1 or min(shards) > 0)
        assert restored.train(2, seed=50) == 6  # training goes on
    finally:
        restored.close()


@pytest.mark.slow
def test_a_trained_dynamic_table_exports_to_serving_as_sorted_keys_and_rows(free_ports, tmp_path):
    zero = {"kind": "constant", "value": 0.0}
    manager = CheckpointManager(tmp_path / "run", max_to_keep=None)
    model = Click(capacity=24)
    model.emb.initializer = zero
    cluster = Cluster(free_ports, 2, model)
    unseen = torch.tensor([[2**62 + 1, -5, 3]])  # no row on any shard: the default (zeros)
    try:
        cluster.train(5)
        cluster.save(manager)
        with torch.no_grad():
            want = cluster.model(torch.cat([POOL.view(-1, 3), unseen]))
        stats = cluster.model.emb.stats()
    finally:
        cluster.close()
    assert 0 < stats["rows"] <= 24 and stats["evicted"] > 0
    towerflow.export(tmp_path / "run", tmp_path / "exports" / "full")
    served = towerflow.serving.load(tmp_path / "exports" / "full", Click())
    assert isinstance(served.emb, towerflow.serving.DynamicLookup)
    with torch.no_grad():
        got = served(torch.cat([POOL.view(-1, 3), unseen]))
    assert torch.allclose(got, want, atol=1e-6)


def test_stats_sum_the_shards_and_status_shows_each_table_shard(free_ports):
    from rich.console import Console

    from towerflow.cli.status import render

    cluster = Cluster(free_ports, 2, Click(admit_after=2, capacity=16))
    try:
        cluster.train(6)
        stats = cluster.model.emb.stats()
        with ClusterObserver(cluster.spec, SECRET, probe_tasks=False) as observer:
            snapshot = observer.snapshot()
    finally:
        cluster.close()
    assert stats["admitted"] > 0 and stats["filtered"] > 0 and stats["evicted"] > 0
    assert stats["rows"] <= 16
    lines = [t for t in snapshot["tables"] if t["name"] == "emb"]
    assert [t["shard"] for t in lines] == [0, 1] and {t["kind"] for t in lines} == {"dynamic"}
    for key, total in (("rows", "rows"), ("admitted", "admitted"), ("evicted", "evicted"),
                       ("filtered", "filtered"), ("nbytes", "bytes")):
        assert sum(t[key] for t in lines) == stats[total], key
    console = Console(width=200, record=True)
    console.print(render({**snapshot, "tasks": [], "ps": [], "workers": []}))
    text = console.export_text()
    assert "sparse tables" in text and "admitted" in text and "dynamic" in text


@pytest.mark.slow
def test_admission_counters_survive_a_checkpoint_restored_onto_another_number_of_ps(
        free_ports, tmp_path):
    manager = CheckpointManager(tmp_path / "run", max_to_keep=None)
    cluster = Cluster(free_ports, 2, Click(admit_after=2))
    once = torch.tensor([[2**61 + 3, -(2**60) - 1, 77]])  # pushed once: counted, no row
    try:
        cluster.train(2)
        cluster.strategy.run_step(loss_fn, (once, torch.ones(1)))
        before = cluster.model.emb.stats()
        cluster.save(manager)
    finally:
        cluster.close()
    restored = Cluster(free_ports, 1, Click(admit_after=2))
    try:
        restore_latest(manager, restored.strategy)
        assert restored.strategy.global_step == 3
        assert restored.model.emb.stats()["rows"] == before["rows"]
        restored.strategy.run_step(loss_fn, (once, torch.ones(1)))  # the second push admits
        stats = restored.model.emb.stats()
        assert stats["rows"] == before["rows"] + 3 and stats["filtered"] == 0
    finally:
        restored.close()


@pytest.mark.slow
def test_a_ps_checkpoint_of_a_dynamic_table_loads_into_one_process_for_eval(free_ports,
                                                                            tmp_path):
    from towerflow.checkpoint import load_into_module, read_checkpoint
    from towerflow.training.evaluate import table_weights

    manager = CheckpointManager(tmp_path / "run", max_to_keep=None)
    cluster = Cluster(free_ports, 2, Click())
    try:
        cluster.train(3)
        cluster.save(manager)
        with torch.no_grad():
            want = cluster.model(POOL.view(-1, 3))
    finally:
        cluster.close()
    ckpt = read_checkpoint(tmp_path / "run")
    model = Click()
    load_into_module(model, {**ckpt.groups["model"], **table_weights(ckpt, model)})
    with torch.no_grad():
        assert torch.allclose(model(POOL.view(-1, 3)), want, atol=1e-6)
    assert model.emb.stats()["rows"] > 0
