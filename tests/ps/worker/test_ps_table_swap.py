"""A model's own embeddings as sparse tables: which are swapped, what they start from.

ps tasks are real ``Server``s on 127.0.0.1 in this process, with
authenticated gRPC; each test starts and stops its own.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from towerflow.cluster import TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.errors import InvalidArgumentError
from towerflow.ps import keep_dense
from towerflow.ps.worker.tables.embedding import ShardedEmbedding
from towerflow.ps.worker.tables.swap import DEFAULT_SPARSE_THRESHOLD, swap_embeddings
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"swap-secret")


@pytest.fixture
def ps_servers(start_ps_tasks):
    """Two full ps tasks (dense and table services) in this process, serving after Done."""
    return start_ps_tasks(SECRET)


class Net(nn.Module):
    """An embedding (any module) summed per example, and a linear head."""

    def __init__(self, emb: nn.Module, dim: int = 4) -> None:
        super().__init__()
        self.emb = emb
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.emb(ids)
        return self.out(rows.sum(1) if rows.dim() == 3 else rows).squeeze(1)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), labels)


def batch(num_rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_rows, (8, 3), generator=g), torch.randint(0, 2, (8,), generator=g).float()


def strategy_for(spec, **options) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", 0), whole_table_bytes=None, credentials=SECRET, device="cpu",
                           server=False, **options)


def all_rows(table: ShardedEmbedding) -> torch.Tensor:
    return table.client.pull(table.config, torch.arange(table.num_rows))


def train(spec, model: nn.Module, optimizer: OptimizerConfig, steps: int = 3,
          **options) -> ParameterServer:
    strategy = strategy_for(spec, **options)
    strategy.prepare(model, optimizer)
    for step in range(steps):
        strategy.run_step(loss_fn, batch(model.emb.num_rows, step))
    return strategy


# --------------------------------------------------------------------------- which are swapped
def test_sparse_true_and_large_modules_become_tables_and_small_ones_stay() -> None:
    model = nn.Sequential(nn.Embedding(100, 4, sparse=True),
                          nn.EmbeddingBag(50, 4, mode="sum", sparse=True),
                          nn.Embedding(1000, 8), nn.Embedding(10, 4),
                          nn.Embedding(DEFAULT_SPARSE_THRESHOLD // 128, 32, device="meta"))
    assert swap_embeddings(model, DEFAULT_SPARSE_THRESHOLD) == ["0", "1", "4"]
    assert [type(m).__name__ for m in model] == ["ShardedEmbedding"] * 2 + ["Embedding"] * 2 + [
        "ShardedEmbedding"]
    assert model[1].mode == "sum" and [n for n, _ in model.named_parameters()] == [
        "2.weight", "3.weight"]
    large = nn.Sequential(nn.Embedding(1000, 8), nn.Embedding(10, 4))
    assert swap_embeddings(large, 1000 * 8 * 4) == ["0"]


def test_none_swaps_nothing_and_keep_dense_keeps_one_module() -> None:
    model = nn.Sequential(nn.Embedding(100, 4, sparse=True))
    assert swap_embeddings(model, None) == [] and isinstance(model[0], nn.Embedding)
    kept = nn.Sequential(keep_dense(nn.Embedding(100, 4, sparse=True)),
                         nn.Embedding(100, 4, sparse=True))
    assert swap_embeddings(kept, 1) == ["1"] and isinstance(kept[0], nn.Embedding)


def test_embeddings_each_under_the_threshold_but_over_it_together_are_said_in_one_line(
        caplog) -> None:
    threshold = 1000 * 8 * 4  # one 1000 x 8 float32 weight
    model = nn.Sequential(*[nn.Embedding(600, 8) for _ in range(3)],  # 1.8x the threshold
                          keep_dense(nn.Embedding(900, 8)))  # kept dense by choice: not counted
    with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
        assert swap_embeddings(model, threshold) == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and re.match(
        r"3 embeddings \('0', '1', '2'\) stay dense, each under the sparse threshold \(32 kB\) "
        r"but 57.6 kB together: every step moves them whole.*sparse=True", said[0]), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="towerflow.ps"):  # under it together: quiet
        swap_embeddings(nn.Sequential(nn.Embedding(300, 8), nn.Embedding(300, 8)), threshold)
        swap_embeddings(nn.Sequential(nn.Embedding(600, 8), nn.Embedding(600, 8)), None)
    assert not caplog.records


def test_the_strategy_swaps_by_default_and_says_so_in_one_line(ps_servers, caplog) -> None:
    model = Net(nn.Embedding(1000, 4, sparse=True))
    strategy = strategy_for(ps_servers)
    try:
        with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
        assert isinstance(model.emb, ShardedEmbedding)
        lines = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
        assert lines == ["'emb' 1,000 x 4 (16 kB) -> rows on 2 ps tasks, row-wise adagrad"]
        assert all(r.levelno == logging.WARNING for r in caplog.records if "->" in r.message)
    finally:
        strategy.shutdown()
    dense = Net(nn.Embedding(1000, 4))
    kept = strategy_for(ps_servers, sparse_threshold_bytes=None)
    try:
        kept.prepare(dense, OptimizerConfig("adagrad", lr=0.1))
        assert isinstance(dense.emb, nn.Embedding)
    finally:
        kept.shutdown()


# --------------------------------------------------------------------------- where tables start
def test_from_pretrained_rows_are_served_bit_exact(ps_servers) -> None:
    vectors = torch.randn(300, 4, generator=torch.Generator().manual_seed(5))
    model = Net(nn.Embedding.from_pretrained(vectors.clone(), freeze=False, sparse=True))
    strategy = strategy_for(ps_servers)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
        strategy._ensure_initialized()
        assert model.emb.take_start() is None  # shipped, then dropped by the worker
        assert torch.equal(all_rows(model.emb), vectors)
    finally:
        strategy.shutdown()


def test_a_frozen_table_is_unchanged_after_three_steps(ps_servers) -> None:
    vectors = torch.randn(60, 4, generator=torch.Generator().manual_seed(6))
    model = Net(nn.Embedding.from_pretrained(vectors.clone(), freeze=True, sparse=True))
    strategy = train(ps_servers, model, OptimizerConfig("sgd", lr=0.5))
    try:
        assert not model.emb.trainable and torch.equal(all_rows(model.emb), vectors)
    finally:
        strategy.shutdown()


def test_the_padding_row_keeps_its_value_and_the_others_train(ps_servers) -> None:
    emb = nn.Embedding(40, 4, padding_idx=3, sparse=True)
    start = emb.weight.detach().clone()
    model = Net(emb)
    strategy = strategy_for(ps_servers)
    try:
        strategy.prepare(model, OptimizerConfig("adam", lr=0.1))
        for step in range(3):
            ids, labels = batch(40, step)
            ids[:, 0] = 3  # every example looks the padding row up
            strategy.run_step(loss_fn, (ids, labels))
        rows = all_rows(model.emb)
        assert torch.equal(rows[3], start[3]) and torch.equal(rows[3], torch.zeros(4))
        assert not torch.equal(rows, start)
    finally:
        strategy.shutdown()


def test_a_meta_built_table_is_drawn_from_the_modules_normal(ps_servers) -> None:
    model = Net(nn.Embedding(4000, 4, padding_idx=0, sparse=True, device="meta"))
    strategy = strategy_for(ps_servers)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
        strategy._ensure_initialized()
        rows = all_rows(model.emb)
        assert torch.equal(rows[0], torch.zeros(4))
        assert abs(float(rows[1:].mean())) < 0.05 and abs(float(rows[1:].std()) - 1.0) < 0.05
    finally:
        strategy.shutdown()


def test_two_towerflow_initialised_tables_start_apart(ps_servers) -> None:
    model = Net(nn.ModuleDict({"a": ShardedEmbedding(20, 4), "b": ShardedEmbedding(20, 4)}))
    strategy = strategy_for(ps_servers)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
        strategy._ensure_initialized()
        a, b = all_rows(model.emb["a"]), all_rows(model.emb["b"])
        assert not torch.equal(a, b) and float(a.abs().max()) <= 0.05
    finally:
        strategy.shutdown()


# --------------------------------------------------------------------------- refusals, bad input
@pytest.mark.parametrize(("module", "message"), [
    (nn.Embedding(10, 4, max_norm=1.0, sparse=True), r"uses max_norm=1\.0"),
    (nn.Embedding(10, 4, scale_grad_by_freq=True, sparse=True), r"uses scale_grad_by_freq=True"),
])
def test_options_without_a_row_wise_form_are_refused_with_the_way_out(module, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message + r".*ShardedEmbedding without it"
                       r".*keep_dense\(module\)"):
        swap_embeddings(nn.Sequential(module), 1)


def test_an_optimizer_without_a_row_wise_form_is_refused(ps_servers) -> None:
    strategy = strategy_for(ps_servers)
    try:
        with pytest.raises(InvalidArgumentError, match=r"no row-wise counterpart of optimizer "
                           r"'momentum' with momentum=0\.9.*give the table its own"):
            strategy.prepare(Net(nn.Embedding(10, 4, sparse=True)),
                             OptimizerConfig("momentum", lr=0.1, momentum=0.9))
    finally:
        strategy.shutdown()


def test_bad_ids_name_the_value_and_change_nothing(ps_servers) -> None:
    model = Net(nn.Embedding(30, 4, sparse=True))
    strategy = strategy_for(ps_servers)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        strategy._ensure_initialized()
        before = all_rows(model.emb)
        labels = torch.ones(2)
        with pytest.raises(InvalidArgumentError, match=r"30"):
            strategy.run_step(loss_fn, (torch.tensor([[1, 30], [2, 3]]), labels))
        with pytest.raises(InvalidArgumentError, match=r"torch\.float32.*ids\.long\(\)"):
            strategy.run_step(loss_fn, (torch.tensor([[1.0, 2.0], [2.0, 3.0]]), labels))
        assert torch.equal(all_rows(model.emb), before)
    finally:
        strategy.shutdown()


def test_only_the_chief_ships_a_modules_weight(ps_servers) -> None:
    from towerflow.strategies.ps_tables import attach_tables

    for chief in (True, False):
        model = Net(nn.Embedding(30, 4, sparse=True))
        tables = attach_tables(model, OptimizerConfig("sgd"), cluster=ps_servers,
                               sparse_threshold=1, chief=chief,
                               credentials=SECRET)
        try:
            start = model.emb.take_start()
            assert (start is not None) == chief  # a worker that does not initialise drops it
        finally:
            tables.close()


def test_the_row_wise_optimizer_takes_the_models_hyperparameters() -> None:
    from towerflow.ps.spec.row_optimizers import sparse_optimizer_for

    adagrad = sparse_optimizer_for(OptimizerConfig("adagrad", initial_accumulator_value=0.5,
                                                   eps=1e-6))
    assert adagrad == {"name": "adagrad", "hyper": {"initial_accumulator_value": 0.5,
                                                    "epsilon": 1e-6}}
    adam = sparse_optimizer_for(OptimizerConfig("adam", betas=(0.8, 0.99), eps=1e-7))
    assert adam == {"name": "lazy_adam", "hyper": {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-7}}
    with pytest.raises(InvalidArgumentError, match=r"weight_decay=0\.01.*give the table its own"):
        sparse_optimizer_for(OptimizerConfig("adam", weight_decay=0.01))


def test_a_table_that_exists_keeps_its_rows_when_a_chief_initialises_again(ps_servers) -> None:
    from towerflow.strategies.ps_tables import attach_tables

    first, second = torch.zeros(20, 4), torch.ones(20, 4)
    for vectors in (first, second):  # the second chief (restarted) finds the table there
        model = Net(nn.Embedding.from_pretrained(vectors, freeze=False, sparse=True))
        tables = attach_tables(model, OptimizerConfig("sgd"), cluster=ps_servers,
                               sparse_threshold=1, chief=True, credentials=SECRET)
        try:
            tables.initialize()
            assert torch.equal(all_rows(model.emb), first)
        finally:
            tables.close()


@pytest.mark.parametrize("threshold", [1 << 20, None])
def test_an_embedding_on_meta_that_stays_dense_is_refused_naming_the_way_out(ps_servers,
                                                                             threshold) -> None:
    """A table built without values (``device="meta"``) under the swap threshold would
    stay on the worker with nothing in it: refused before anything reaches the ps."""
    model = Net(nn.Embedding(1000, 4, device="meta"))
    strategy = strategy_for(ps_servers, sparse_threshold_bytes=threshold)
    try:
        with pytest.raises(InvalidArgumentError) as raised:
            strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))
        message = str(raised.value)
        assert message.startswith("emb.weight (16,000 bytes) is on the meta device (no values)")
        assert ("sparse_threshold_bytes is 1,048,576" if threshold else
                "sparse_threshold_bytes=None: no table is swapped") in message
        assert ("nn.Embedding(..., sparse=True), lower sparse_threshold_bytes" if threshold else
                "Give the strategy a sparse_threshold_bytes") in message
        assert message.endswith(", or build it with values.")
        assert isinstance(model.emb, nn.Embedding)  # the model as it was
    finally:
        strategy.shutdown()
    sparse = Net(nn.Embedding(1000, 4, sparse=True, device="meta"))  # the way out
    strategy = train(ps_servers, sparse, OptimizerConfig("adagrad", lr=0.1), steps=1)
    strategy.shutdown()
    assert isinstance(sparse.emb, ShardedEmbedding)
