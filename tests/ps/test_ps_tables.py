"""Sparse tables on the ps tasks: the Tables service, its client, ShardedEmbedding, the strategy.

ps tasks are real ``Server``s on 127.0.0.1 (in this process, or as child
processes for the multi-worker runs), with authenticated gRPC.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from towerflow.ps.partition import ModPartitioner, RangePartitioner
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.tables import table_spec
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.ps.worker.tables.swap import swap_embeddings
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.processes import stop_processes

SECRET = Credentials(secret=b"tables-secret")
INIT = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 3}
PROGRAM = Path(__file__).parents[1] / "support" / "programs" / "sparse_click.py"


def config(num_rows: int = 20, dim: int = 3, *, name: str = "t", optimizer=None,
           num_shards: int = 2, partitioner=None) -> TableConfig:
    return TableConfig(name, partitioner or ModPartitioner(num_shards, num_rows=num_rows), dim,
                       optimizer or {"name": "sgd", "hyper": {}}, INIT)


def expected_rows(ids, dim: int = 3, init=INIT) -> torch.Tensor:
    return UniformRows(**{k: v for k, v in init.items() if k != "kind"})(ids, dim, torch.float32)


@pytest.fixture
def cluster(table_ps_tasks):
    """Two ps tasks serving only the table service, and a client of them."""
    spec, clients = table_ps_tasks(SECRET)
    return spec, clients(1)[0]


def raw_push(spec, shard: int, **fields) -> tpb.PushRowsReply:
    ids = fields.pop("ids")
    grads = fields.pop("grads")
    request = tpb.PushRowsRequest(table="t", shard=shard, worker_id=0, incarnation=1, seq=1,
                                  lr=0.5, step=1, num_ids=len(ids), dtype="float32",
                                  ids=torch.tensor(ids, dtype=torch.int64).numpy().tobytes(),
                                  grads=torch.as_tensor(grads).numpy().tobytes())
    for key, value in fields.items():
        setattr(request, key, value)
    return tpb.PushRowsReply.FromString(call_shard(spec, shard, "PushRows", request))


def call_shard(spec, shard: int, method: str, request) -> bytes:
    """One authenticated call of the Tables service of ps task ``shard``."""
    channel = make_channel(spec.task_address("ps", shard), SECRET)
    try:
        return unary(channel, f"/towerflow.ps.Tables/{method}", request.SerializeToString(),
                     timeout=10)
    finally:
        channel.close()


def table_rows(client, cfg) -> torch.Tensor:
    return client.pull(cfg, torch.arange(cfg.num_rows))


# --------------------------------------------------------------------------- the service
def test_a_pull_returns_exactly_the_requested_rows_in_order(cluster):
    _, client = cluster
    cfg = config()
    assert [r.created for r in client.init_table(cfg)] == [True, True]
    ids = torch.tensor([7, 0, 19, 7, 4, 13])  # both shards, a repeat, unsorted
    torch.testing.assert_close(client.pull(cfg, ids), expected_rows(ids), rtol=0, atol=0)
    statuses = [client.status(cfg, s) for s in range(2)]
    assert [s.rows for s in statuses] == [10, 10]
    assert sum(s.pulled_rows for s in statuses) == ids.numel()  # one request per shard
    assert client.pull(cfg, torch.empty(0, dtype=torch.int64)).shape == (0, 3)


def test_a_range_partitioned_table_pulls_from_its_owners(cluster):
    _, client = cluster
    cfg = config(partitioner=RangePartitioner(20, 2))
    client.init_table(cfg)
    ids = torch.tensor([3, 15, 9, 10])
    torch.testing.assert_close(client.pull(cfg, ids), expected_rows(ids), rtol=0, atol=0)
    assert [client.status(cfg, s).pulled_rows for s in range(2)] == [2, 2]


def test_init_table_is_idempotent_and_refuses_another_description(cluster):
    _, client = cluster
    client.init_table(config())
    client.push(config(), torch.tensor([1]), torch.ones(1, 3), lr=1.0, step=1)
    assert [r.created for r in client.init_table(config())] == [False, False]
    assert client.status(config(), 1).applied == 1  # the same table, not a fresh one
    with pytest.raises(FailedPreconditionError, match=r"Table 't' shard 0 exists as .* and "
                                                      r"cannot become .*another name"):
        client.init_table(config(dim=4))
    with pytest.raises(NotFoundError, match=r"Table 'u' shard 0 is not on this ps task"):
        client.pull(config(name="u"), torch.tensor([0]))


def test_a_push_of_duplicate_ids_sums_them(cluster):
    _, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    ids = torch.tensor([5, 2, 5, 5, 2, 8])
    grads = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    replies = client.push(cfg, ids, grads, lr=0.5, step=1)
    assert [r.status for r in replies] == ["applied", "applied"]
    reference = before.clone()
    reference.index_add_(0, ids, grads, alpha=-0.5)
    torch.testing.assert_close(table_rows(client, cfg), reference)


def test_a_retried_push_is_applied_once(cluster):
    spec, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    first = raw_push(spec, 0, ids=[4], grads=[[1.0, 1.0, 1.0]])
    again = raw_push(spec, 0, ids=[4], grads=[[1.0, 1.0, 1.0]])
    assert (first.status, first.duplicate, again.status, again.duplicate) == \
        ("applied", False, "applied", True)
    assert again.applied == 1
    torch.testing.assert_close(table_rows(client, cfg)[4], before[4] - 0.5)
    with pytest.raises(FailedPreconditionError, match=r"incarnation 0, superseded by "
                                                      r"incarnation 1"):
        raw_push(spec, 0, ids=[4], grads=[[1.0, 1.0, 1.0]], incarnation=0, seq=2)
    later = raw_push(spec, 0, ids=[4], grads=[[1.0, 1.0, 1.0]], incarnation=2)
    assert later.status == "applied" and not later.duplicate  # a restarted worker's seq 1
    # an incarnation no honest start can reach is refused and remembered nowhere
    with pytest.raises(FailedPreconditionError, match=r"incarnation 18446744073709551615, more "
                                                      r"than 300 s ahead of this ps's clock"):
        raw_push(spec, 0, ids=[4], grads=[[1.0, 1.0, 1.0]], incarnation=(1 << 64) - 1)
    restarted = raw_push(spec, 0, ids=[4], grads=[[1.0, 1.0, 1.0]], incarnation=time.time_ns())
    assert restarted.status == "applied" and not restarted.duplicate


def test_a_push_whose_result_would_overflow_is_refused_with_nothing_applied(cluster):
    spec, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    with pytest.raises(InvalidArgumentError, match=r"learning rate 1e\+38 would make the rows of "
                                                   r"storage row 2 non-finite .*nothing was applied"):
        raw_push(spec, 0, ids=[2, 4], grads=[[1.0] * 3, [10.0] * 3], lr=1e38)
    torch.testing.assert_close(table_rows(client, cfg), before)
    assert raw_push(spec, 0, ids=[4], grads=[[1.0] * 3], seq=2).status == "applied"


@pytest.mark.parametrize(("shard", "fields", "pattern"), [
    (0, {"ids": [-2], "grads": [[1.0] * 3]}, r"ids\[0\] = -2 is not in \[0, 20\)"),
    (0, {"ids": [20], "grads": [[1.0] * 3]}, r"ids\[0\] = 20 is not in \[0, 20\)"),
    (0, {"ids": [2, 3], "grads": [[1.0] * 3] * 2},
     r"ids\[1\] = 3 belongs to shard 1, not shard 0"),
    (0, {"ids": [2, 4], "grads": [[1.0] * 3, [1.0, float("nan"), 1.0]]},
     r"row gradients of id 4 hold \[1\.0, nan, 1\.0\], not finite; nothing was applied"),
    (1, {"ids": [1], "grads": [[float("inf")] * 3]}, r"row gradients of id 1 hold \[inf"),
    (0, {"ids": [2], "grads": [[1.0] * 3], "dtype": "float64"},
     r"holds float32 rows but the row gradients are 'float64'"),
    (0, {"ids": [2], "grads": [[1.0] * 2]}, r"row gradients holds 8 bytes but 3 values"),
    (0, {"ids": [2], "grads": [[1.0] * 3], "lr": float("nan")},
     r"learning rate must be a finite number"),
    (0, {"ids": [2], "grads": [[1.0] * 3], "step": 0}, r"step must be the update's number"),
    (0, {"ids": [2], "grads": [[1.0] * 3], "seq": 0}, r"seq >= 1"),
])
def test_bad_pushes_are_refused_naming_the_value_and_nothing_is_applied(cluster, shard, fields,
                                                                        pattern):
    spec, client = cluster
    cfg = config()
    client.init_table(cfg)
    before = table_rows(client, cfg)
    with pytest.raises(InvalidArgumentError, match=pattern):
        raw_push(spec, shard, **fields)
    torch.testing.assert_close(table_rows(client, cfg), before, rtol=0, atol=0)
    assert [client.status(cfg, s).applied for s in range(2)] == [0, 0]
    assert not any(client.status(cfg, s).pushes for s in range(2))  # a refusal is not recorded


def test_bad_tables_and_ids_are_refused(cluster):
    _, client = cluster
    with pytest.raises(InvalidArgumentError, match=r"Unknown sparse optimizer 'rmsprop'"):
        client.init_table(config(optimizer={"name": "rmsprop", "hyper": {}}))
    with pytest.raises(InvalidArgumentError, match=r"split into 3 shards but the cluster has 2"):
        client.init_table(config(num_shards=3))
    client.init_table(config())
    with pytest.raises(InvalidArgumentError, match=r"dtype torch\.int64, got torch\.int32"):
        client.pull(config(), torch.tensor([1], dtype=torch.int32))


def test_export_streams_rows_slots_and_push_table_in_chunks_and_import_restores(cluster):
    _, client = cluster
    cfg = config(optimizer={"name": "adagrad", "hyper": {"initial_accumulator_value": 0.1}})
    client.init_table(cfg)
    client.push(cfg, torch.tensor([1, 3, 4]), torch.ones(3, 3), lr=0.1, step=1)
    chunks = list(client.export_shard(cfg, 1, chunk_rows=4))
    assert [c.num_ids for c in chunks] == [4, 4, 2] and chunks[0].total == 10
    assert [(p.worker_id, p.status) for p in chunks[0].pushes] == [(0, "applied")]
    ids = torch.cat([torch.frombuffer(bytearray(c.ids), dtype=torch.int64) for c in chunks])
    assert ids.tolist() == list(range(1, 20, 2))
    accum = torch.cat([torch.frombuffer(bytearray(c.slots[0]), dtype=torch.float32)
                       for c in chunks]).view(10, 3)
    assert chunks[0].slot_names == ["accumulator"]
    torch.testing.assert_close(accum[:3], torch.tensor([[1.1] * 3, [1.1] * 3, [0.1] * 3]))
    saved = table_rows(client, cfg)
    client.push(cfg, torch.tensor([1, 3]), torch.ones(2, 3), lr=0.1, step=2)
    pieces = [(torch.frombuffer(bytearray(c.ids), dtype=torch.int64),
               torch.frombuffer(bytearray(c.rows), dtype=torch.float32).view(-1, 3),
               {"accumulator": torch.frombuffer(bytearray(c.slots[0]),
                                                dtype=torch.float32).view(-1, 3)})
              for c in chunks]
    assert client.import_rows(cfg, 1, pieces) == 10
    torch.testing.assert_close(table_rows(client, cfg)[1::2], saved[1::2], rtol=0, atol=0)
    with pytest.raises(InvalidArgumentError, match=r"ids\[0\] = 0 belongs to shard 0"):
        client.import_rows(cfg, 1, [(torch.tensor([0]), torch.zeros(1, 3), None)])


# --------------------------------------------------------------------------- the module
def test_an_unbound_sharded_embedding_says_how_to_use_it():
    with pytest.raises(FailedPreconditionError, match=r"not bound to ps tasks.*ParameterServer"):
        ShardedEmbedding(10, 2)(torch.tensor([1]))
    with pytest.raises(InvalidArgumentError, match=r"mode='avg'; use None or one of"):
        ShardedEmbedding(10, 2, mode="avg")


def test_swap_replaces_large_embeddings_and_drops_their_weight():
    model = nn.Sequential(nn.Embedding(1000, 8), nn.EmbeddingBag(10, 8, mode="sum"))
    assert swap_embeddings(model, 1000 * 8 * 4) == ["0"]
    assert isinstance(model[0], ShardedEmbedding) and (model[0].num_rows, model[0].dim) == (1000, 8)
    assert [n for n, _ in model.named_parameters()] == ["1.weight"]
    with pytest.raises(InvalidArgumentError, match=r"uses include_last_offset=True"):
        swap_embeddings(nn.Sequential(nn.EmbeddingBag(1000, 8, include_last_offset=True)), 1)


class Click(nn.Module):
    """A tiny click model: a bag of id embeddings and a linear layer."""

    def __init__(self, num_rows: int, dim: int = 4, embedding: nn.Module | None = None) -> None:
        super().__init__()
        self.emb = embedding or ShardedEmbedding(num_rows, dim, mode="sum", initializer=INIT)
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


def click_loss(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


@pytest.fixture
def ps_servers(start_ps_tasks):
    """Two full ps tasks (dense and table services) in this process, serving after Done."""
    return start_ps_tasks(SECRET)


@pytest.mark.parametrize("swap", [False, True])
def test_a_step_through_the_strategy_matches_a_local_sgd_step(ps_servers, swap):
    _strategy_step_matches_local_sgd(ps_servers, swap=swap, defer=False)


def test_a_deferred_push_through_the_strategy_is_seen_by_the_next_lookup_and_at_shutdown(
        ps_servers):
    _strategy_step_matches_local_sgd(ps_servers, swap=False, defer=True)


def _strategy_step_matches_local_sgd(ps_servers, *, swap: bool, defer: bool) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (8, 5))
    ids[0, :2] = 7  # a row used twice in one bag
    labels = torch.randint(0, 2, (8,)).float()
    local = Click(50, embedding=nn.EmbeddingBag(50, 4, mode="sum"))
    with torch.no_grad():  # a swapped table starts from the module's own weight
        local.emb.weight.copy_(expected_rows(torch.arange(50), 4, INIT))
    swapped = nn.EmbeddingBag(50, 4, mode="sum")
    swapped.load_state_dict(local.emb.state_dict())
    model = Click(50, embedding=swapped if swap else
                  ShardedEmbedding(50, 4, mode="sum", initializer=INIT, defer_push=defer))
    model.out.load_state_dict(local.out.state_dict())
    strategy = ParameterServer(ps_servers, TaskInfo("worker", 0), credentials=SECRET,
                               device="cpu", server=False,
                               sparse_threshold_bytes=100 if swap else None)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        assert isinstance(model.emb, ShardedEmbedding) and not hasattr(model.emb, "weight")
        result = strategy.run_step(click_loss, (ids, labels))
        assert result.global_step == 1
        optimizer = torch.optim.SGD(local.parameters(), lr=0.5)
        click_loss(local, (ids, labels)).backward()
        optimizer.step()
        if defer:  # kept for the next pull: another worker does not see it yet
            viewer = TableClient(ps_servers.job_tasks("ps"), credentials=SECRET, worker_id=1)
            unseen = viewer.pull(model.emb.config, torch.arange(50))
            torch.testing.assert_close(unseen, expected_rows(torch.arange(50), 4), rtol=0,
                                       atol=0)
            with torch.no_grad():  # this worker's next lookup sends it and sees it
                model.emb(torch.arange(50).view(1, 50))
            assert model.emb.client.deferred() == 0
            strategy.run_step(click_loss, (ids, labels))  # a second deferred push ...
            assert model.emb.client.deferred() > 0
        rows = model.emb.client.pull(model.emb.config, torch.arange(50))
        if not defer:
            torch.testing.assert_close(rows, local.emb.weight.detach())
            # a swapped table defers its pushes, and the dense push waits for the next pull
            # (ParameterServer(dense_with_rows=True)): reading the global step sends it
            assert strategy.global_step == 1
            torch.testing.assert_close(model.out.weight, local.out.weight)
    finally:
        strategy.shutdown()
    if defer:  # ... sent at shutdown, before the worker's Done
        optimizer.zero_grad()
        click_loss(local, (ids, labels)).backward()
        optimizer.step()
        try:
            torch.testing.assert_close(viewer.pull(model.emb.config, torch.arange(50)),
                                       local.emb.weight.detach())
        finally:
            viewer.close()


# --------------------------------------------------------------------------- real processes
def _run_cluster(free_ports, subprocess_env, tmp_path, *, num_rows: int, steps: int,
                 workers: int = 2, extra: tuple[str, ...] = ()) -> list[dict]:
    """Start 2 ps and ``workers`` workers running tests/support/programs/sparse_click.py; their reports."""
    ports = free_ports(2 + workers)
    spec = {"ps": [f"127.0.0.1:{p}" for p in ports[:2]],
            "worker": [f"127.0.0.1:{p}" for p in ports[2:]]}
    env = {**subprocess_env, "TOWERFLOW_SECRET": SECRET.secret.decode()}
    common = [sys.executable, str(PROGRAM), "--cluster", json.dumps(spec),
              "--num-rows", str(num_rows), "--steps", str(steps), *extra]
    ps = [subprocess.Popen([*common, "--job", "ps", "--index", str(i)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
          for i in range(2)]
    try:
        procs = [subprocess.Popen([*common, "--job", "worker", "--index", str(i),
                                   "--report", str(tmp_path / f"w{i}.json")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(workers)]
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
        return [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(workers)]
    finally:
        stop_processes(ps, grace=10)


@pytest.mark.slow
def test_two_ps_two_workers_async_training_of_a_click_model_reduces_the_loss(
        free_ports, subprocess_env, tmp_path):
    reports = _run_cluster(free_ports, subprocess_env, tmp_path, num_rows=5000, steps=150)
    for report in reports:
        assert report["final_loss"] < 0.8 * report["first_loss"], report
    assert max(r["global_step"] for r in reports) >= 250  # both workers' pushes count


@pytest.mark.slow
def test_a_workers_memory_does_not_grow_with_the_table(free_ports, subprocess_env, tmp_path):
    # 16 values per row: the 10M-row table (640 MB) is well above a worker's own ~350 MB
    small = _run_cluster(free_ports, subprocess_env, tmp_path, num_rows=1_000_000, steps=30,
                         workers=1, extra=("--dim", "16"))[0]
    large = _run_cluster(free_ports, subprocess_env, tmp_path, num_rows=10_000_000, steps=30,
                         workers=1, extra=("--dim", "16"))[0]
    table_bytes = 10_000_000 * 16 * 4
    assert large["peak_rss"] < 1.10 * small["peak_rss"], (small, large)
    assert large["peak_rss"] < table_bytes  # it never held the table


# --------------------------------------------------------------------------- lookups
class _LocalRows:
    """A table client stand-in that answers pulls from a local table."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def pull(self, cfg, ids):
        return self.table.index_select(0, ids)


@pytest.mark.parametrize(("mode", "kwargs"), [
    (None, {}), ("sum", {}), ("mean", {}), ("max", {}),
    ("sum", {"offsets": True}), ("mean", {"per_sample_weights": True}),
])
def test_a_lookup_and_its_row_gradients_match_torch_embedding_modules(mode, kwargs):
    torch.manual_seed(0)
    table = torch.randn(50, 4, dtype=torch.float64)
    ids = torch.randint(0, 50, (6, 5))
    module = ShardedEmbedding(50, 4, mode=mode, dtype=torch.float64)
    module.bind(_LocalRows(table), config(50, 4))
    reference = (nn.Embedding if mode is None else nn.EmbeddingBag)(
        50, 4, dtype=torch.float64, **({} if mode is None else {"mode": mode}))
    reference.weight.data.copy_(table)
    args = [ids]
    if kwargs.get("offsets"):
        args = [ids.reshape(-1), torch.tensor([0, 4, 11, 11, 20])]
    extra = {}
    if kwargs.get("per_sample_weights"):
        mode = "sum"  # torch takes per-sample weights with sum bags only
        module.mode = reference.mode = mode
        extra["per_sample_weights"] = torch.rand(6, 5, dtype=torch.float64)
    weights = torch.randn(4, dtype=torch.float64)
    got, want = module(*args, **extra), reference(*args, **extra)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (got @ weights).sum().backward()
    (want @ weights).sum().backward()
    unique, grads = module.take_row_grads()
    assert unique.tolist() == sorted(set(ids.reshape(-1).tolist()))
    torch.testing.assert_close(grads, reference.weight.grad[unique], rtol=0, atol=1e-12)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[unique] = False
    assert not reference.weight.grad[untouched].any()


def test_a_ps_task_that_cannot_be_reached_is_an_unavailable_error(free_ports):
    from towerflow.errors import UnavailableError

    address = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    client = TableClient([address], credentials=SECRET, timeout=2.0, retries=1)
    try:
        with pytest.raises(UnavailableError, match=r"failed with UNAVAILABLE"):
            client.pull(config(num_shards=1), torch.tensor([1, 2]))
    finally:
        client.close()


# -- bounds checked before the work ------------------------------------------------------------
def test_a_pull_whose_reply_would_be_too_large_is_refused_before_any_row_is_read() -> None:
    import psutil

    from towerflow.ps.server.tables.shard import ROWS_REPLY_LIMIT, TableShard

    shard = TableShard(table_spec(config(num_rows=1 << 21, dim=32, num_shards=1), 0))
    count = 1 << 20
    ids = torch.arange(count, dtype=torch.int64).numpy().tobytes()
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ResourceExhaustedError, match=r"a pull of 1,048,576 rows x 32 needs a 128 "
                                                     r"MiB reply, more than 63 MiB; pull fewer"):
        shard.pull(ids, count)
    with pytest.raises(ResourceExhaustedError, match=r"a pull of 1,048,576 rows x 32"):
        shard.push_pull(None, ids, count)  # the pull of a push-and-pull too
    assert psutil.Process().memory_info().rss - rss < 32 << 20
    fits = ROWS_REPLY_LIMIT // (32 * 4)
    assert len(shard.pull(ids[:fits * 8], fits)) == fits * 32 * 4


def test_an_import_carrying_too_many_push_records_imports_nothing() -> None:
    from towerflow.ps.server.pushes import MAX_REPLICAS_TRACKED
    from towerflow.ps.server.tables.shard import TableShard
    from towerflow.ps.wire import ps_pb2 as pb

    cfg = config(num_shards=1)
    shard = TableShard(table_spec(cfg, 0))
    before = shard.store.export().rows.clone()
    records = [pb.PushRecord(worker_id=w, incarnation=1, seq=1, status="applied")
               for w in range(MAX_REPLICAS_TRACKED + 1)]
    chunk = tpb.RowChunk(pushes=records, num_ids=1, ids=torch.tensor([3]).numpy().tobytes(),
                         rows=torch.ones(1, 3).numpy().tobytes())
    with pytest.raises(InvalidArgumentError, match=r"an import carries 4,097 push records, more "
                                                   r"than the 4096 worker ids a shard keeps; "
                                                   r"nothing was imported"):
        shard.import_chunks([chunk])
    torch.testing.assert_close(shard.store.export().rows, before)
    del chunk.pushes[MAX_REPLICAS_TRACKED:]
    assert shard.import_chunks([chunk]) == 1
    assert len(shard.status()["pushes"]) == MAX_REPLICAS_TRACKED
