"""Sparse tables in checkpoints: saved sharded with slots and push tables, restored re-sharded.

ps tasks are real ``Server``s on 127.0.0.1 with authenticated gRPC (in this
process for the re-sharding tests; child processes for the memory test, so
the chief's peak memory is its own).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import CheckpointError, InvalidArgumentError
from towerflow.ps.spec.row_optimizers import SparseLazyAdam
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.tables.checkpoint import TABLES_GROUP
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.processes import stop_processes
from towerflow.training.session import checkpoint_metadata, restore_latest

SECRET = Credentials(secret=b"table-checkpoint-secret")
INIT = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 5}
PROGRAM = Path(__file__).parents[2] / "support" / "programs" / "table_checkpoint_rss.py"
ROWS, CTX_ROWS = 41, 23


class Click(nn.Module):
    """Two tables (modulo-sharded Adagrad, range-sharded lazy Adam) and a dense layer."""

    def __init__(self, dim: int = 3, tables: bool = True, rows: int = ROWS) -> None:
        super().__init__()
        if tables:
            self.emb = ShardedEmbedding(rows, dim, mode="sum", initializer=INIT, name="emb")
            self.ctx = ShardedEmbedding(CTX_ROWS, 2, mode="mean", partitioner="range",
                                        optimizer=SparseLazyAdam(), name="ctx")
        self.out = nn.Linear(dim + 2, 1)
        self.tables = tables

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, ctx = batch
        if not self.tables:
            return self.out(torch.zeros(ids.shape[0], self.out.in_features)).squeeze(1)
        return self.out(torch.cat([self.emb(ids), self.ctx(ctx)], 1)).squeeze(1)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, ctx, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model((ids, ctx)), labels)


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, ROWS, (16, 4), generator=gen),
            torch.randint(0, CTX_ROWS, (16, 2), generator=gen),
            torch.randint(0, 2, (16,), generator=gen).float())


class Cluster:
    """``num_ps`` ps tasks and a chief training ``Click`` on them."""

    def __init__(self, free_ports, num_ps: int, model: nn.Module | None = None) -> None:
        ports = free_ports(num_ps + 2)  # two replicas: worker 1 pushes below
        self.spec = ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:-2]],
                                 "worker": [f"127.0.0.1:{p}" for p in ports[-2:]]})
        self.servers = [Server(self.spec, "ps", i, credentials=SECRET) for i in range(num_ps)]
        self.strategy = ParameterServer(self.spec, TaskInfo("worker", 0), credentials=SECRET,
                                        device="cpu", server=False, table_part_bytes=200)
        self.model = Click() if model is None else model
        self.strategy.prepare(self.model, OptimizerConfig("adagrad", lr=0.3))

    def train(self, steps: int, seed: int = 0) -> int:
        for i in range(steps):
            step = self.strategy.run_step(loss_fn, batch(seed + i)).global_step
        return step

    def save(self, manager: CheckpointManager) -> Path:
        groups = self.strategy.state_dict()
        metadata = checkpoint_metadata(self.strategy)
        return manager.save(metadata["step"], groups, metadata)

    def tables(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every table's ids (sorted), rows and slots, read from all its shards."""
        client = self.strategy._tables.client
        out = {}
        for module in (self.model.emb, self.model.ctx):
            config = module.config
            parts: dict[str, list[torch.Tensor]] = {}
            for shard in range(client.num_shards):
                for chunk in client.export_shard(config, shard):
                    n = chunk.num_ids
                    parts.setdefault("ids", []).append(
                        torch.frombuffer(bytearray(chunk.ids), dtype=torch.int64))
                    for name, data in [("rows", chunk.rows),
                                       *zip(chunk.slot_names, chunk.slots, strict=True)]:
                        values = torch.frombuffer(bytearray(data), dtype=torch.float32)
                        parts.setdefault(name, []).append(values.view(n, config.dim))
            joined = {k: torch.cat(v) for k, v in parts.items()}
            order = torch.argsort(joined["ids"])
            out[config.name] = {k: v[order] for k, v in joined.items()}
        return out

    def raw_push(self, table: str, row: int, seq: int) -> tpb.PushRowsReply:
        """A push of worker 1 (incarnation 1) to the owner of ``row``, as a retry sends it."""
        module = self.model.emb if table == "emb" else self.model.ctx
        shard = int(module.config.partitioner.shard_of(torch.tensor([row]))[0])
        request = tpb.PushRowsRequest(
            table=table, shard=shard, worker_id=1, incarnation=1, seq=seq, lr=0.5, step=1,
            num_ids=1, dtype="float32", ids=torch.tensor([row]).numpy().tobytes(),
            grads=torch.ones(1, module.config.dim).numpy().tobytes())
        channel = make_channel(self.spec.task_address("ps", shard), SECRET)
        try:
            data = unary(channel, "/towerflow.ps.Tables/PushRows", request.SerializeToString(),
                         timeout=10)
        finally:
            channel.close()
        return tpb.PushRowsReply.FromString(data)

    def close(self) -> None:
        try:
            self.strategy.shutdown()
        finally:
            for server in self.servers:
                server.stop()


def assert_same_tables(got, want) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)


def train_and_save(free_ports, num_ps: int, run: Path, steps: tuple[int, ...] = (3,)):
    """Train and checkpoint after each count of ``steps``; the tables at each checkpoint."""
    cluster = Cluster(free_ports, num_ps)
    manager = CheckpointManager(run, max_to_keep=None)
    saved = []
    try:
        for i, count in enumerate(steps):
            cluster.train(count, seed=100 * i)
            if i == 0:
                assert cluster.raw_push("emb", 4, seq=1).status == "applied"
            path = cluster.save(manager)
            saved.append((path, cluster.tables()))
    finally:
        cluster.close()
    return manager, saved


@pytest.mark.parametrize("old, new", [(2, 1), (2, 3), (1, 2), (2, 2)])
def test_tables_restore_to_another_number_of_ps_tasks_and_training_continues(
        free_ports, tmp_path, old, new):
    manager, [(path, saved)] = train_and_save(free_ports, old, tmp_path / "run")
    parts = read_checkpoint(path).chunked[TABLES_GROUP].infos
    assert {(p["table"], p["shard"]) for p in parts} == \
        {(t, s) for t in ("emb", "ctx") for s in range(old)}
    assert max(p["part"] for p in parts) >= 1  # several files per shard (part_bytes=200)
    # push tables on disk: JSON rows [worker, incarnation, seq, status] in a shard's first part
    records = [r for p in parts if p["table"] == "emb" and p["part"] == 0 for r in p["pushes"]]
    assert [1, 1, 1, "applied"] in records
    assert all(type(r[0]) is int and type(r[3]) is str for r in records)
    cluster = Cluster(free_ports, new)
    try:
        ckpt = restore_latest(manager, cluster.strategy)
        assert cluster.strategy.global_step == ckpt.step == 3
        restored = cluster.tables()
        assert_same_tables(restored, saved)  # rows and slots identical per id
        assert set(restored["ctx"]) == {"ids", "rows", "m", "v"}
        assert not torch.equal(restored["emb"]["accumulator"],
                               torch.full_like(restored["emb"]["accumulator"], 0.1))
        # the push table survived: the retried push is answered, not applied again
        retry = cluster.raw_push("emb", 4, seq=1)
        assert (retry.status, retry.duplicate) == ("applied", True)
        assert_same_tables(cluster.tables(), saved)
        assert cluster.raw_push("emb", 4, seq=2).duplicate is False  # a new push applies
        assert cluster.train(2, seed=7) == 5
        after = cluster.tables()
        assert not torch.equal(after["emb"]["rows"], saved["emb"]["rows"])
        assert not torch.equal(after["ctx"]["m"], saved["ctx"]["m"])
    finally:
        cluster.close()


def test_a_damaged_table_file_falls_back_to_the_previous_checkpoint(free_ports, tmp_path,
                                                                    caplog):
    manager, saved = train_and_save(free_ports, 2, tmp_path / "run", steps=(2, 2))
    (first, first_tables), (newest, _) = saved
    part = newest / "ps_tables-00003.safetensors"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x10
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ps_tables-00003\.safetensors.*fails its "
                                              r"checksum"):
        read_checkpoint(newest)
    cluster = Cluster(free_ports, 1)
    try:
        with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
            ckpt = restore_latest(manager, cluster.strategy)
        assert ckpt.path == first and "ps_tables-00003.safetensors" in caplog.text
        assert cluster.strategy.global_step == 2
        assert_same_tables(cluster.tables(), first_tables)
    finally:
        cluster.close()


def test_a_checkpoint_restores_only_into_tables_of_the_same_shape(free_ports, tmp_path):
    manager, _ = train_and_save(free_ports, 2, tmp_path / "run", steps=(1,))
    cluster = Cluster(free_ports, 2, model=Click(rows=ROWS + 9))
    try:
        restore_latest(manager, cluster.strategy)
        with pytest.raises(InvalidArgumentError, match=r"tables do not match the model's: table "
                                                       r"'emb' has num_rows=50 but the "
                                                       r"checkpoint's has 41\. Restore it into"):
            cluster.strategy.global_step  # noqa: B018 - the restore runs at the first use
    finally:
        cluster.close()


def test_a_checkpoint_written_without_tables_starts_them_afresh_with_a_warning(
        free_ports, tmp_path, caplog):
    run = tmp_path / "run"
    dense = Cluster(free_ports, 2, model=Click(tables=False))
    try:
        dense.strategy.run_step(loss_fn, batch(0))
        dense.save(CheckpointManager(run))
    finally:
        dense.close()
    cluster = Cluster(free_ports, 2)
    try:
        with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
            restore_latest(CheckpointManager(run), cluster.strategy)
            assert cluster.strategy.global_step == 1
        assert "holds no sparse tables" in caplog.text
        rows = cluster.tables()["emb"]["rows"]
        from towerflow.ps.spec.initializers import UniformRows

        expected = UniformRows(-0.5, 0.5, 5)(torch.arange(ROWS), 3, torch.float32)
        assert torch.equal(rows, expected)
    finally:
        cluster.close()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="measures peak memory through Linux's /proc/self/clear_refs")
def test_the_chiefs_memory_stays_bounded_while_saving_and_restoring_a_large_table(
        free_ports, subprocess_env, tmp_path):
    num_rows, dim = 600_000, 32
    ports = free_ports(3)
    spec = json.dumps({"ps": [f"127.0.0.1:{p}" for p in ports[:2]],
                       "worker": [f"127.0.0.1:{ports[2]}"]})
    env = {**subprocess_env, "TOWERFLOW_SECRET": "rss-secret"}
    common = [sys.executable, str(PROGRAM), "--cluster", spec, "--num-rows", str(num_rows),
              "--dim", str(dim), "--part-bytes", str(2 << 20), "--train-dir", str(tmp_path)]
    ps = [subprocess.Popen([*common, "--job", "ps", "--index", str(i)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    try:
        chief = subprocess.run([*common, "--job", "worker", "--index", "0", "--report",
                                str(tmp_path / "report.json")], env=env, capture_output=True,
                               text=True, timeout=300)
        assert chief.returncode == 0, chief.stderr[-3000:]
    finally:  # a ps task ends once the chief said Done; one that does not is killed
        stop_processes(ps, grace=30, terminate=False)
    report = json.loads((tmp_path / "report.json").read_text())
    table_bytes = num_rows * dim * 4 * 2  # rows and the Adagrad accumulator
    assert report["parts"] >= 2 * 8  # many part files per shard
    assert report["restored_rows"] == num_rows
    for phase in ("save", "read", "restore"):
        growth = report[f"peak_during_{phase}"] - report[f"rss_before_{phase}"]
        assert growth < table_bytes / 3, (phase, report)  # a few parts and buffers


# -- damaged parts and descriptions: one CheckpointError each, at restore and at eval -------------
class _Reader:
    """A checkpoint's table parts as :class:`ChunkedReader` gives them (infos, then parts)."""

    def __init__(self, parts) -> None:  # type: ignore[no-untyped-def]
        self._parts = parts
        self.infos = [info for info, _ in parts]

    def parts(self):  # type: ignore[no-untyped-def]
        yield from self._parts


def _saved_table():  # type: ignore[no-untyped-def]
    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.spec.tables import TableConfig
    from towerflow.ps.worker.tables.checkpoint import describe_tables

    config = TableConfig("emb", ModPartitioner(2, num_rows=10), 3,
                         {"name": "adagrad", "hyper": {}}, INIT)
    saved = describe_tables([config])
    parts = []
    for shard in range(2):
        ids = torch.arange(shard, 10, 2)
        parts.append(({"table": "emb", "shard": shard, "part": 0, "rows": 5, "shard_rows": 5,
                       "pushes": [[0, 1, 3, "applied"]]},
                      {"ids": ids, "rows": torch.rand(5, 3), "slot.accumulator": torch.ones(5, 3)}))
    return saved, parts


def _split_repeating(saved, parts):  # type: ignore[no-untyped-def]
    info, tensors = parts[0]
    first = ({**info, "rows": 3, "shard_rows": 5},
             {k: v[:3] for k, v in tensors.items()})
    again = ({"table": "emb", "shard": 0, "part": 1, "rows": 2},
             {k: v[:2] for k, v in tensors.items()})  # ids 0, 2 again: 6, 8 go missing
    return saved, [first, again, parts[1]]


def _edit(key, value, where="info"):  # type: ignore[no-untyped-def]
    def edit(saved, parts):  # type: ignore[no-untyped-def]
        info, tensors = parts[0]
        if where == "info":
            info = {**info, key: value}
        else:
            tensors = {**tensors, key: value}
        return saved, [(info, tensors), *parts[1:]]
    return edit


def _describe(**changes):  # type: ignore[no-untyped-def]
    def edit(saved, parts):  # type: ignore[no-untyped-def]
        emb = json.loads(json.dumps(saved["emb"]))
        for key, value in changes.items():
            if key == "num_shards":
                emb["partitioner"]["num_shards"] = value
            else:
                emb[key] = value
        return {"emb": emb}, parts
    return edit


DAMAGE = [
    ("a part repeating another's ids", _split_repeating, r"ids do not rise strictly"),
    ("rows stored as int64", _edit("rows", torch.ones(5, 3, dtype=torch.int64), "tensors"),
     r"shard 0 part 0: rows is torch\.int64 \[5, 3\], not float32 \[5, 3\]"),
    ("rows holding NaN", _edit("rows", torch.full((5, 3), float("nan")), "tensors"),
     r"rows holds NaN or infinity"),
    ("a slot of the wrong shape", _edit("slot.accumulator", torch.ones(4, 3), "tensors"),
     r"slot\.accumulator is torch\.float32 \[4, 3\], not float32 \[5, 3\]"),
    ("rows of dim 9", _edit("rows", torch.ones(5, 9), "tensors"), r"not float32 \[5, 3\]"),
    ("ids out of range", _edit("ids", torch.tensor([0, 2, 4, 6, 1 << 40]), "tensors"),
     r"shard 0 part 0: .*1099511627776"),
    ("shard 'abc'", _edit("shard", "abc"), r"a part whose shard is 'abc', not an integer"),
    ("malformed push records", _edit("pushes", [[0, 1]]), r"push records \[\[0, 1\]\] are not"),
    ("worker id 2**40", _edit("pushes", [[1 << 40, 1, 1, "applied"]]), r"push records"),
    ("num_shards 10**12", _describe(num_shards=10**12), r"with 1 \.\. 65536 shards"),
    ("num_shards 2**62", _describe(num_shards=1 << 62), r"with 1 \.\. 65536 shards"),
    ("num_shards 10**7", _describe(num_shards=10**7), r"with 1 \.\. 65536 shards"),
    ("a description that is not an object", lambda s, p: ({"emb": [1, 2]}, p),
     r"description of table 'emb' is \[1, 2\], not an object"),
    ("metadata without its tables", lambda s, p: (None, p), r"metadata has no 'tables'"),
]


@pytest.mark.parametrize(("damage", "pattern"), [(d[1], d[2]) for d in DAMAGE],
                         ids=[d[0] for d in DAMAGE])
def test_each_damaged_table_part_is_one_checkpoint_error_at_restore_and_eval(damage, pattern):
    import types

    from towerflow.ps.worker.tables.checkpoint import import_tables
    from towerflow.training.evaluate import table_weights

    saved, parts = damage(*_saved_table())
    reader = _Reader(parts)

    class NoPs:  # takes what a restore sends before it meets the damaged part
        num_shards, max_call_bytes = 2, 1 << 20

        def init_table(self, config) -> None:  # type: ignore[no-untyped-def]
            pass

        def import_rows(self, config, shard, pieces, pushes=()) -> None:  # type: ignore[no-untyped-def]
            list(pieces)

    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.spec.tables import TableConfig

    config = TableConfig("emb", ModPartitioner(2, num_rows=10), 3,
                         {"name": "adagrad", "hyper": {}}, INIT)
    with pytest.raises(CheckpointError, match=pattern):
        import_tables(NoPs(), [config], reader, saved)
    model = nn.Module()
    model.emb = nn.Embedding(10, 3)
    ckpt = types.SimpleNamespace(chunked={TABLES_GROUP: reader}, path=Path("ckpt-1"),
                                 metadata={} if saved is None else {"strategy": {"tables": saved}})
    with pytest.raises(CheckpointError, match=pattern):
        table_weights(ckpt, model)


def test_a_sound_table_part_set_is_read_back_at_eval() -> None:
    import types

    from towerflow.training.evaluate import table_weights

    saved, parts = _saved_table()
    model = nn.Module()
    model.emb = nn.Embedding(10, 3)
    ckpt = types.SimpleNamespace(chunked={TABLES_GROUP: _Reader(parts)}, path=Path("c"),
                                 metadata={"strategy": {"tables": saved}})
    weight = table_weights(ckpt, model)["emb.weight"]
    torch.testing.assert_close(weight[1::2], parts[1][1]["rows"])
