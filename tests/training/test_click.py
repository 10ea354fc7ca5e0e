"""The click task's parts: the planted logs' stream, the model, the task's settings, its tables."""

from __future__ import annotations

import re

import pytest
import torch

from towerflow.checkpoint import ChunkedGroup
from towerflow.checkpoint.format import read_checkpoint_dir, write_checkpoint_dir
from towerflow.cli import main
from towerflow.data.clicks import ClickLogs, ClickStream, auc
from towerflow.errors import CheckpointError, InvalidArgumentError
from towerflow.models.click import ClickNet, click_loss
from towerflow.training.evaluate import table_weights
from towerflow.training.summaries import parameter_histograms
from towerflow.training.tasks import ClickTask, get_task


def small_logs() -> ClickLogs:
    return ClickLogs([500], bag=4, zipf=1.2, ctr=0.2, weight_std=0.5, seed=3)


def take(stream: ClickStream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_replicas_draw_their_own_batches_and_a_resumed_stream_repeats_its_own() -> None:
    stream = ClickStream(small_logs(), batch_size=64, seed=5)
    first = take(stream, 4)
    assert stream.state() == {"batches": 4}
    ids, clicks = first[0]
    assert ids.shape == (64, 4) and ids.dtype == torch.int64 and clicks.dtype == torch.float32
    other = take(stream.for_replica(1), 4)
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))
    resumed = ClickStream(small_logs(), batch_size=64, seed=5)
    resumed.load_state({"batches": 2})
    again = take(resumed, 2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(first[2:], again, strict=True))
    assert take(stream.for_replica(0, batch_size=16), 1)[0][0].shape == (16, 4)


@pytest.mark.parametrize("state", [{"batches": -1}, {"batches": "3"}, {}, {"batches": True}])
def test_a_bad_stream_position_is_refused_naming_it(state) -> None:
    with pytest.raises(InvalidArgumentError, match=r"ClickStream position .* is not "
                       r"\{'batches': n >= 0\}; resume from a checkpoint of this task"):
        ClickStream(small_logs(), batch_size=4, seed=0).load_state(state)


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"rows": []}, r"needs one or more fields of at least one row each, got rows=\[\]"),
    ({"rows": [10, 0]}, r"got rows=\[10, 0\]"),
    ({"bag": 0}, r"bag=0 must be at least 1 id per example"),
    ({"ctr": 1.0}, r"ctr=1.0 must be strictly between 0 and 1"),
])
def test_bad_click_logs_settings_are_refused_naming_the_value(kwargs, pattern) -> None:
    settings = {"rows": [10], "bag": 2, "zipf": 1.2, "ctr": 0.2, "weight_std": 0.5, "seed": 0}
    rows = {**settings, **kwargs}.pop("rows")
    rest = {k: v for k, v in {**settings, **kwargs}.items() if k != "rows"}
    with pytest.raises(InvalidArgumentError, match=pattern):
        ClickLogs(rows, **rest)


def test_the_model_fits_the_planted_truth_in_one_process() -> None:
    torch.manual_seed(0)
    logs = small_logs()
    model = ClickNet(500, 8, sparse_gradients=True)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=1e-4)
    stream = iter(ClickStream(logs, batch_size=256, seed=0))
    for _ in range(150):
        opt.zero_grad()
        click_loss(model, next(stream)).backward()
        opt.step()
    assert model.table.weight.grad.is_sparse  # only the touched rows
    fields, clicks = logs.sample(20000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        model_auc = auc(model(fields[0]), clicks)
    assert model_auc > auc(logs.logits(fields), clicks) - 0.03


def test_the_task_reads_its_settings_and_leaves_a_table_the_ps_holds_unallocated() -> None:
    settings = {"table_rows": 5000, "embedding_dim": 8, "ids_per_example": 3, "seed": 2}
    local = get_task("click", settings)
    assert isinstance(local, ClickTask)
    assert (local.table_rows, local.embedding_dim, local.ids_per_example) == (5000, 8, 3)
    model = local.build_train_model()
    assert not model.table.weight.is_meta and model.table.sparse  # Adagrad: sparse gradients
    sharded = get_task("click", {**settings, "sparse_threshold": 5000 * 8 * 4})
    table = sharded.build_train_model().table.weight
    assert table.is_meta and table.shape == (5000, 8)  # no memory: the strategy swaps it
    assert not sharded.build_model().table.weight.is_meta  # eval's model holds it
    sparse = get_task("click", {**settings, "sparse_threshold": 5000 * 8 * 4 + 1})
    assert sparse.build_train_model().table.weight.is_meta  # sparse=True: a table anyway
    assert get_task("click", {**settings, "ps": 2}).build_train_model().table.weight.is_meta
    kept = get_task("click", {**settings, "sparse_threshold": "off"})
    assert not kept.build_train_model().table.weight.is_meta  # off: dense
    dense = get_task("click", {**settings, "optimizer": "adam", "ps": 2,
                               "sparse_threshold": 5000 * 8 * 4 + 1})
    assert not dense.build_train_model().table.weight.is_meta  # below the threshold: dense
    assert not get_task("click", {**settings, "optimizer": "adam"}).build_model().table.sparse
    with pytest.raises(InvalidArgumentError, match=r"table_rows must be at least 1, got 0; "
                       r"pass --table-rows N >= 1"):
        get_task("click", {"table_rows": 0})


def test_a_sparse_gradient_is_summarised_by_its_rows() -> None:
    table = torch.nn.EmbeddingBag(100, 4, mode="sum", sparse=True)
    table(torch.tensor([[1, 2, 2]])).sum().backward()
    hist = parameter_histograms(table.named_parameters())
    assert hist["weight/gradients"].shape == (2, 4)  # rows 1 and 2
    assert torch.equal(hist["weight/gradients"], torch.tensor([[1.0] * 4, [2.0] * 4]))


def _table_checkpoint(tmp_path, parts) -> object:
    """A checkpoint of sparse table parts ``(table, shard, ids, rows)``, one part per shard,
    described as tables of 6 x 2 over as many ps tasks as the parts name."""
    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.spec.tables import TableConfig
    from towerflow.ps.worker.tables.checkpoint import describe_tables

    group = ChunkedGroup(({"table": name, "shard": s, "part": 0, "rows": len(ids),
                           "shard_rows": len(ids), "pushes": []}, {"ids": ids, "rows": rows})
                         for name, s, ids, rows in parts)
    shards = len({p[1] for p in parts})
    tables = describe_tables([TableConfig(name, ModPartitioner(shards, num_rows=6), 2,
                                          {"name": "sgd", "hyper": {}},
                                          {"kind": "constant", "value": 0.0})
                              for name in sorted({p[0] for p in parts})])
    path = write_checkpoint_dir(tmp_path / "c", 7, {"model": {}, "ps_tables": group},
                                {"strategy": {"tables": tables}})
    return read_checkpoint_dir(path)


def test_a_table_saved_by_the_ps_tasks_fills_the_models_weight(tmp_path) -> None:
    model = ClickNet(6, 2)
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)
    ckpt = _table_checkpoint(tmp_path, [("table", 0, torch.tensor([0, 2, 4]), rows[0::2]),
                                        ("table", 1, torch.tensor([1, 3, 5]), rows[1::2])])
    assert torch.equal(table_weights(ckpt, model)["table.weight"], rows)


def test_a_saved_table_that_is_short_or_not_the_models_is_refused(tmp_path) -> None:
    model = ClickNet(6, 2)
    short = _table_checkpoint(tmp_path / "a", [("table", 0, torch.tensor([0, 2]),
                                                torch.zeros(2, 2))])
    with pytest.raises(CheckpointError, match=r"table 'table' is incomplete: it was saved from "
                       r"1 ps shards but its parts hold shards \[0\] with rows \[\(2, 2\)\]; "
                       r"restore an earlier checkpoint"):
        table_weights(short, model)
    other = _table_checkpoint(tmp_path / "b", [("emb", 0, torch.arange(6), torch.zeros(6, 2))])
    with pytest.raises(CheckpointError, match=r"holds table 'emb', which is no table of ClickNet"):
        table_weights(other, model)


def test_the_click_options_of_another_model_are_refused(tmp_path, capsys) -> None:
    assert main(["train", "digits", "--table-rows", "5", "--train-dir", str(tmp_path)]) == 2
    assert re.search(r"--table-rows 5 applies to the click model only, not digits; remove it, "
                     r"or train click\.", capsys.readouterr().err)
