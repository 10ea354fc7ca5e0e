"""A ps run's table, saved as parts of rows, is read back for ``towerflow eval`` on the device
the checkpoint was read onto (the model's): table_weights builds the weight where the rows
are, never on the CPU alone (on a GPU: torch's "index is on cuda:0, different from other
tensors on cpu" from index_copy_)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from towerflow.checkpoint import CheckpointManager, ChunkedGroup, read_checkpoint
from towerflow.ps.worker.tables.checkpoint import TABLES_GROUP
from towerflow.strategies import ps_tables
from towerflow.training.evaluate import evaluate_checkpoint, table_weights
from towerflow.training.tasks import ClickTask

ROWS, DIM = 6, 2


def _task() -> ClickTask:
    return ClickTask(ROWS, DIM, 4, tables_on_ps=True)


def _ps_run(train_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint of a ps run of the click model: its table saved by two ps shards as parts
    of rows (with Adagrad's accumulator), the rest of the model as weights. Returns the
    table's rows and accumulator."""
    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.spec.tables import TableConfig
    from towerflow.ps.worker.tables.checkpoint import describe_tables

    rows = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM) / 10
    accumulator = rows + 1
    model = _task().build_model()
    dense = {k: v for k, v in model.state_dict().items() if k != "table.weight"}
    parts = ChunkedGroup(
        ({"table": "table", "shard": s, "part": 0, "rows": ROWS // 2, "shard_rows": ROWS // 2,
          "pushes": []},
         {"ids": torch.arange(s, ROWS, 2), "rows": rows[s::2],
          "slot.accumulator": accumulator[s::2]})
        for s in range(2))
    tables = describe_tables([TableConfig("table", ModPartitioner(2, num_rows=ROWS), DIM,
                                          {"name": "adagrad", "hyper": {}},
                                          {"kind": "constant", "value": 0.0})])
    CheckpointManager(train_dir).save(7, {"model": dense, TABLES_GROUP: parts},
                                      {"strategy": {"tables": tables}})
    return rows, accumulator


def test_table_weights_are_built_on_the_device_the_checkpoints_rows_come_on(
        tmp_path, monkeypatch) -> None:
    """A CPU machine has no second real device: the rows come on the meta device, which
    index_copy_ accepts without values, and the weight must be built there too."""
    _ps_run(tmp_path)
    ckpt = read_checkpoint(tmp_path)
    checked = ps_tables.checked_parts

    def on_meta(reader, saved):  # type: ignore[no-untyped-def]  # checked as read, then moved
        for info, tensors in checked(reader, saved):
            yield info, {name: t.to("meta") for name, t in tensors.items()}

    monkeypatch.setattr(ps_tables, "checked_parts", on_meta)
    slots: dict[str, torch.Tensor] = {}
    weights = ps_tables.table_weights(ckpt.chunked, ckpt.metadata["strategy"],
                                      _task().build_model(), ckpt.path, slots=slots)
    assert {k: (v.device.type, tuple(v.shape)) for k, v in {**weights, **slots}.items()} == {
        "table.weight": ("meta", (ROWS, DIM)), "table.weight/sum": ("meta", (ROWS, DIM))}


@pytest.mark.parametrize("model_device", ["cpu", "meta"])
def test_rows_read_onto_the_cpu_fill_a_cpu_weight_whatever_the_models_table_is_on(
        tmp_path, model_device) -> None:
    rows, accumulator = _ps_run(tmp_path)
    ckpt = read_checkpoint(tmp_path, device="cpu")  # what towerflow eval passes: its target
    model = _task().build_model()
    model.table.to(model_device)  # meta: a ps worker's model, its table never allocated
    slots: dict[str, torch.Tensor] = {}
    weights = ps_tables.table_weights(ckpt.chunked, ckpt.metadata["strategy"], model,
                                      ckpt.path, slots=slots)
    assert weights["table.weight"].device == torch.device("cpu")
    assert torch.equal(weights["table.weight"], rows)
    assert torch.equal(slots["table.weight/sum"], accumulator)


def test_eval_of_a_ps_run_loads_its_table_on_the_cpu(tmp_path) -> None:
    _ps_run(tmp_path)
    result = evaluate_checkpoint(_task(), tmp_path, device="cpu", batch_size=4096)
    assert (result.step, result.metric) == (7, "AUC") and 0.0 <= result.precision <= 1.0


@pytest.mark.gpu
def test_eval_of_a_ps_run_loads_its_table_on_the_gpu(tmp_path) -> None:
    rows, _ = _ps_run(tmp_path)
    ckpt = read_checkpoint(tmp_path, device="cuda")
    model = _task().build_model().to("cuda")
    weight = table_weights(ckpt, model)["table.weight"]
    assert weight.device.type == "cuda" and torch.equal(weight.cpu(), rows)
    on_cpu = evaluate_checkpoint(_task(), tmp_path, device="cpu", batch_size=4096)
    on_gpu = evaluate_checkpoint(_task(), tmp_path, device="cuda", batch_size=4096)
    # the same model either way; the GPU's sums round otherwise, which reorders near-ties of
    # this untrained model's scores (seen: 1.7e-4 of AUC on an H200)
    assert on_gpu.step == 7 and on_gpu.precision == pytest.approx(on_cpu.precision, abs=5e-3)
