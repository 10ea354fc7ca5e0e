"""A small ``sparse=True`` embedding travels whole with the dense variables, where that is the
faster path and the optimizer updates it alike; larger ones, other optimizers and
``whole_table_bytes=None`` keep the row path. One line per table says which and why.

ps tasks are real ``Server``s on 127.0.0.1 in this process (authenticated gRPC).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.ps.worker.tables.swap import SMALL_TABLE_BYTES
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks

SECRET = Credentials(secret=b"whole-tables")
USERS, ITEMS, DIM = 943, 1682, 16  # MovieLens-100k's users and movies: 60 kB and 108 kB


class Ratings(nn.Module):
    """Users and movies the plain PyTorch way, ``sparse=True``, and a bigger table (of
    another row width by default: rows of the users' width would join it, see below)."""

    def __init__(self, big_rows: int = 8192, tag_dim: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.user = nn.Embedding(USERS, DIM, sparse=True)
        self.item = nn.Embedding.from_pretrained(torch.randn(ITEMS, DIM, generator=g) * 0.1,
                                                 freeze=False, sparse=True)
        self.tag = nn.EmbeddingBag(big_rows, tag_dim, mode="sum", sparse=True)  # 256 KiB: rows
        self.out = nn.Linear(2 * DIM + tag_dim, 1)

    def forward(self, user, item, tags):  # type: ignore[no-untyped-def]
        x = torch.cat([self.user(user), self.item(item), self.tag(tags)], 1)
        return self.out(x).squeeze(1)


def batch(seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    user, item = torch.randint(0, USERS, (64,), generator=g), torch.randint(0, ITEMS, (64,),
                                                                             generator=g)
    tags = torch.randint(0, 8192, (64, 3), generator=g)
    return user, item, tags, ((user + item) % 2).float()


def loss_fn(model: nn.Module, b) -> torch.Tensor:  # type: ignore[no-untyped-def]
    *x, labels = b
    return nn.functional.binary_cross_entropy_with_logits(model(*x), labels)


def trained(optimizer: OptimizerConfig, steps: int = 4, tag_dim: int = 8,  # type: ignore[no-untyped-def]
            **options):
    torch.manual_seed(0)
    model = Ratings(tag_dim=tag_dim)
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                   device="cpu", server=False, **options)
        try:
            strategy.prepare(model, optimizer)
            for step in range(steps):
                strategy.run_step(loss_fn, batch(step))
            strategy.settle()
            with torch.no_grad():
                rows = {name: (module.client.pull(module.config, torch.arange(module.num_rows))
                               if isinstance(module, ShardedEmbedding) else module.weight.clone())
                        for name, module in (("user", model.user), ("item", model.item))}
        finally:
            strategy.shutdown()
    return model, rows


def test_small_sparse_tables_travel_whole_and_say_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
        model, _ = trained(OptimizerConfig("adagrad", lr=0.1), steps=1)
    assert isinstance(model.user, nn.Embedding) and not model.user.sparse
    assert isinstance(model.item, nn.Embedding) and isinstance(model.tag, ShardedEmbedding)
    lines = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert lines[:2] == [
        f"'user' 943 x 16 (60.4 kB) -> whole with the dense variables: sparse=True, but under "
        f"{SMALL_TABLE_BYTES >> 10} KiB its rows cost less moved whole than as a row request "
        "(towerflow.ps.ShardedEmbedding keeps it rows)",
        "'item' 1,682 x 16 (108 kB) -> whole with the dense variables: sparse=True, but under "
        "256 KiB its rows cost less moved whole than as a row request "
        "(towerflow.ps.ShardedEmbedding keeps it rows)"]
    assert lines[2] == "'tag' 8,192 x 8 (262 kB) -> rows on 2 ps tasks, row-wise adagrad"


def test_small_tables_of_the_kind_of_a_rows_table_join_its_rows_and_say_so(caplog) -> None:
    """A table of the users' width is rows anyway: the users and movies are fused with it on
    the ps and looked up with it as one, not moved whole."""
    with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
        model, rows = trained(OptimizerConfig("adagrad", lr=0.1), steps=2, tag_dim=DIM)
    assert all(isinstance(m, ShardedEmbedding) for m in (model.user, model.item, model.tag))
    lines = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert lines[:2] == [
        "'user' 943 x 16 (60.4 kB) -> rows: under 256 KiB, but looked up with 'tag', whose "
        "rows are pulled each step anyway (one table on the ps, one lookup on the worker)",
        "'item' 1,682 x 16 (108 kB) -> rows: under 256 KiB, but looked up with 'tag', whose "
        "rows are pulled each step anyway (one table on the ps, one lookup on the worker)"]
    _, whole = trained(OptimizerConfig("adagrad", lr=0.1), steps=2, tag_dim=DIM,
                       whole_table_bytes=1 << 30)  # every small one whole: trained alike
    for table in ("user", "item"):
        torch.testing.assert_close(whole[table], rows[table], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_whole_and_rows_train_alike(name: str) -> None:
    optimizer = OptimizerConfig(name, lr=0.1)
    _, whole = trained(optimizer)
    _, rows = trained(optimizer, whole_table_bytes=None)
    for table in ("user", "item"):
        torch.testing.assert_close(whole[table], rows[table], rtol=1e-5, atol=1e-6)


def test_sync_mode_keeps_the_row_path() -> None:
    """A sync step averages a row over the replicas that pushed it, a dense variable over all."""
    model, _ = trained(OptimizerConfig("adagrad", lr=0.1), steps=1, mode="sync")
    assert isinstance(model.user, ShardedEmbedding) and isinstance(model.item, ShardedEmbedding)


def test_a_checkpoint_of_these_tables_as_rows_is_refused_with_the_way_out(tmp_path) -> None:
    from towerflow.checkpoint import CheckpointManager
    from towerflow.errors import InvalidArgumentError
    from towerflow.training.session import checkpoint_metadata, restore_latest

    manager = CheckpointManager(tmp_path / "rows")
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                   device="cpu", server=False, whole_table_bytes=None)
        try:
            strategy.prepare(Ratings(), OptimizerConfig("adagrad", lr=0.1))
            strategy.run_step(loss_fn, batch(0))
            groups = strategy.state_dict()
            metadata = checkpoint_metadata(strategy)
            manager.save(metadata["step"], groups, metadata)
        finally:
            strategy.shutdown()
    with ps_tasks(SECRET) as spec:
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET,
                                   device="cpu", server=False)
        try:
            strategy.prepare(Ratings(), OptimizerConfig("adagrad", lr=0.1))
            with pytest.raises(InvalidArgumentError, match=r"'user', 'item' as rows .*"
                                                           r"--whole-tables off"):
                restore_latest(manager, strategy)
        finally:
            strategy.shutdown()


def test_an_optimizer_that_would_update_untouched_rows_keeps_the_row_path(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
        model, _ = trained(OptimizerConfig("adam", lr=0.01), steps=1)  # lazy Adam row-wise
    assert isinstance(model.user, ShardedEmbedding) and isinstance(model.item, ShardedEmbedding)
    assert not any("whole with the dense" in r.getMessage() for r in caplog.records)
