"""``towerflow export --cluster`` / ``--live``: an export of what a running job's ps tasks hold.

Two ps tasks are real ``Server``s on 127.0.0.1 in this process (authenticated gRPC); a
worker trains a model with two tables the ps lays end to end (same width), one of its own
width and a dense layer. A process outside the job (here: the command in this process,
with its own channels) exports it while the train dir's newest checkpoint is older, and
the export is compared with one of a checkpoint taken at the same step elsewhere.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from towerflow import serving
from towerflow.checkpoint import CheckpointManager
from towerflow.cli import main
from towerflow.cluster import TaskInfo
from towerflow.cluster.address_book import published
from towerflow.cluster.transport import Credentials
from towerflow.serving.chain import read_export, table_state
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks
from towerflow.training.session import checkpoint_metadata

SECRET = b"live-export-secret"
CREDENTIALS = Credentials(secret=SECRET)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(30, 4, sparse=True)  # user and item share one table on the ps
        self.item = nn.Embedding(40, 4, sparse=True)
        self.ctx = nn.Embedding(12, 3, sparse=True)
        self.out = nn.Linear(11, 1)

    def forward(self, user: torch.Tensor, item: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.user(user), self.item(item), self.ctx(ctx)], 1)
        return self.out(x).squeeze(1)


def batch(seed: int, n: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    user, item = torch.randint(0, 30, (n,), generator=g), torch.randint(0, 40, (n,), generator=g)
    return user, item, torch.randint(0, 12, (n,), generator=g), (item % 2).float()


def loss_fn(model: nn.Module, b) -> torch.Tensor:
    *x, labels = b
    return nn.functional.binary_cross_entropy_with_logits(model(*x), labels)


def cluster_args(tmp_path, spec) -> list[str]:
    """``--cluster FILE --secret-file FILE`` of ``spec``, written in ``tmp_path``."""
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec.as_dict()))
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    return ["--cluster", str(cluster_file), "--secret-file", str(secret_file)]


def _save(strategy: ParameterServer, manager: CheckpointManager):
    groups = strategy.state_dict()
    metadata = checkpoint_metadata(strategy)
    return manager.save(metadata["step"], groups, metadata)


@pytest.fixture
def job(tmp_path):
    """A running job: (cluster JSON file, secret file, train dir, strategy, model)."""
    with ps_tasks(CREDENTIALS) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=CREDENTIALS,
                                   device="cpu", server=False, table_part_bytes=256)
        try:
            model = Model()
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
            cluster_file = tmp_path / "cluster.json"
            cluster_file.write_text(json.dumps(spec.as_dict()))
            secret_file = tmp_path / "secret"
            secret_file.write_bytes(SECRET)
            secret_file.chmod(0o600)
            yield cluster_file, secret_file, tmp_path / "train", strategy, model
        finally:
            strategy.shutdown()


def test_a_live_export_equals_the_export_of_a_checkpoint_at_the_same_step(job, tmp_path,
                                                                          capsys) -> None:
    cluster_file, secret_file, train_dir, strategy, model = job
    manager = CheckpointManager(train_dir, max_to_keep=None)
    for seed in range(3):
        strategy.run_step(loss_fn, batch(seed))
    first = _save(strategy, manager)
    assert "fused_tables" in json.loads((first / "manifest.json").read_text())["metadata"][
        "strategy"], "the checkpoint says which tables share one table on the ps"
    for seed in range(3, 6):  # the job trains on past its newest checkpoint
        strategy.run_step(loss_fn, batch(seed))
    # the state now, checkpointed elsewhere (which also sends the worker's deferred pushes)
    now = _save(strategy, CheckpointManager(tmp_path / "elsewhere"))
    want = serving.export(now, tmp_path / "from-checkpoint")
    assert main(["export", "--train-dir", str(train_dir), "--out", str(tmp_path / "live"),
                 "--cluster", str(cluster_file), "--secret-file", str(secret_file)]) == 0
    said = capsys.readouterr().out
    assert re.search(r"^exported step 6 \(full: 82 rows of 3 table\(s\)\) to ", said, re.M), said
    live = read_export(tmp_path / "live")
    assert live.description["step"] == read_export(want).description["step"] == 6
    assert live.description["tables"] == read_export(want).description["tables"]
    assert live.dense.keys() == read_export(want).dense.keys()
    for key, tensor in read_export(want).dense.items():
        assert torch.equal(live.dense[key], tensor), key
    for name in ("user", "item", "ctx"):
        assert torch.equal(table_state([live], name).weight,
                           table_state([read_export(want)], name).weight), name
    # served, it answers as the job's model does
    model.eval()
    served = serving.load(tmp_path / "live", Model())
    with torch.no_grad():
        x = batch(99)[:3]
        torch.testing.assert_close(served(*x), model(*x), rtol=0, atol=1e-6)


def test_live_reads_a_local_runs_address_book_and_secret(job, tmp_path) -> None:
    cluster_file, _, train_dir, strategy, _ = job
    strategy.run_step(loss_fn, batch(0))
    _save(strategy, CheckpointManager(train_dir))
    from towerflow.cluster import ClusterSpec

    spec = ClusterSpec(json.loads(cluster_file.read_text()))
    with published(train_dir, spec, SECRET):
        assert main(["export", "--train-dir", str(train_dir), "--out", str(tmp_path / "e"),
                     "--live"]) == 0
    assert read_export(tmp_path / "e").description["step"] == 1


def test_a_live_export_needs_a_checkpoint_and_the_right_secret(job, tmp_path, capsys) -> None:
    cluster_file, secret_file, train_dir, strategy, _ = job
    args = ["export", "--train-dir", str(train_dir), "--out", str(tmp_path / "e"),
            "--cluster", str(cluster_file), "--secret-file", str(secret_file)]
    assert main(args) == 2
    assert re.search(r"No checkpoint in .*: a live export takes the tables' descriptions",
                     capsys.readouterr().err)
    strategy.run_step(loss_fn, batch(0))
    _save(strategy, CheckpointManager(train_dir))
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"not-the-secret")
    wrong.chmod(0o600)
    assert main([*args[:-1], str(wrong)]) == 2
    assert re.search(r"Status to 127\.0\.0\.1:\d+ failed with UNAUTHENTICATED: .*wrong "
                     r"credentials", capsys.readouterr().err)
    assert not (tmp_path / "e").exists()


def test_a_checkpoint_of_other_tables_is_refused_and_nothing_is_written(job, tmp_path,
                                                                        capsys) -> None:
    cluster_file, secret_file, train_dir, strategy, _ = job
    strategy.run_step(loss_fn, batch(0))
    groups = strategy.state_dict()
    metadata = checkpoint_metadata(strategy)
    tables = metadata["strategy"]["tables"]
    tables["other"] = tables.pop("ctx")  # a table the cluster does not hold
    CheckpointManager(train_dir).save(metadata["step"], groups, metadata)
    assert main(["export", "--train-dir", str(train_dir), "--out", str(tmp_path / "e"),
                 "--cluster", str(cluster_file), "--secret-file", str(secret_file)]) == 2
    assert re.search(r"The cluster does not hold table 'other' of the newest checkpoint",
                     capsys.readouterr().err)
    assert not (tmp_path / "e").exists()


class Raw(nn.Module):
    """Raw 64-bit ids: a dynamic table and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        import towerflow

        self.ids = towerflow.DynamicEmbedding(3, mode="sum")
        self.out = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ids(ids)).squeeze(1)


def raw_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2**62, 2**62, (6, 2), generator=g)
    return ids, (ids[:, 0] % 2).float()


def test_a_live_export_of_a_dynamic_table_equals_a_checkpoints(tmp_path) -> None:
    with ps_tasks(CREDENTIALS) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=CREDENTIALS,
                                   device="cpu", server=False)
        try:
            strategy.prepare(Raw(), OptimizerConfig("adagrad", lr=0.3))
            strategy.run_step(loss_fn_raw, raw_batch(0))
            _save(strategy, CheckpointManager(tmp_path / "train"))
            for seed in (1, 2):
                strategy.run_step(loss_fn_raw, raw_batch(seed))
            want = serving.export(_save(strategy, CheckpointManager(tmp_path / "elsewhere")),
                                  tmp_path / "want")
            assert main(["export", "--train-dir", str(tmp_path / "train"), "--out",
                         str(tmp_path / "live"), *cluster_args(tmp_path, spec)]) == 0
        finally:
            strategy.shutdown()
    live, expected = read_export(tmp_path / "live"), read_export(want)
    assert live.description["step"] == expected.description["step"] == 3
    got, ref = table_state([live], "ids"), table_state([expected], "ids")
    assert torch.equal(got.keys, ref.keys) and torch.equal(got.rows, ref.rows)
    assert got.keys.numel() == 36  # every id of the 3 batches of 6 x 2 got a row


def loss_fn_raw(model: nn.Module, b) -> torch.Tensor:
    ids, labels = b
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


def test_a_live_export_of_a_hybrid_job_takes_its_dense_layers_from_the_newest_checkpoint(
        tmp_path, capsys) -> None:
    with ps_tasks(CREDENTIALS) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), dense="allreduce",
                                   whole_table_bytes=None, credentials=CREDENTIALS, device="cpu",
                                   server=False)
        try:
            model = Model()
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.3))
            for seed in range(3):
                strategy.run_step(loss_fn, batch(seed))
            first = _save(strategy, CheckpointManager(tmp_path / "train"))
            for seed in range(3, 6):  # the job trains on past its newest checkpoint
                strategy.run_step(loss_fn, batch(seed))
            now = serving.export(_save(strategy, CheckpointManager(tmp_path / "elsewhere")),
                                 tmp_path / "now")
            assert main(["export", "--train-dir", str(tmp_path / "train"), "--out",
                         str(tmp_path / "live"), *cluster_args(tmp_path, spec)]) == 0
        finally:
            strategy.shutdown()
    said = capsys.readouterr().out
    assert "keeps its dense layers on its workers: this export holds those of its newest " \
           "checkpoint (step 3)" in said, said
    live, then = read_export(tmp_path / "live"), read_export(serving.export(first,
                                                                            tmp_path / "then"))
    assert live.description["step"] == 3
    for key, tensor in then.dense.items():  # the dense layers: the checkpoint's
        assert torch.equal(live.dense[key], tensor), key
    for name in ("user", "item", "ctx"):  # the tables: as the ps tasks hold them now
        assert torch.equal(table_state([live], name).weight,
                           table_state([read_export(now)], name).weight), name
