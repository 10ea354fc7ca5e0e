"""``ExportHook``: full exports then deltas while training runs, published atomically,
old ones removed by retention.

The trainer is a stand-in whose state is a ps-shaped checkpoint state (a ``model``
group, table parts per shard, the tables' descriptions); its rows change each step.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from towerflow import serving
from towerflow.checkpoint import ChunkedGroup
from towerflow.errors import InvalidArgumentError, TowerflowError
from towerflow.serving.chain import read_export
from towerflow.training.export_hook import ExportHook
from towerflow.training.hooks import StepContext

ROWS, DIM = 20_000, 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Strategy:
    is_chief = True


class Trainer:
    """A trainer whose table rows ``step * 10 .. step * 10 + 9`` change at each step."""

    def __init__(self) -> None:
        self.strategy, self.step = Strategy(), 0
        self.table = torch.zeros(ROWS, DIM)

    def advance(self) -> StepContext:
        self.step += 1
        self.table[self.step * 10:self.step * 10 + 10] += self.step
        return StepContext(self.step, 100, None, None, 1)

    def checkpoint_state(self):
        table = self.table.clone()
        parts = ChunkedGroup(({"table": "emb", "shard": s, "part": 0},
                              {"ids": torch.arange(s, ROWS, 2), "rows": table[s::2]})
                             for s in range(2))
        tables = {"emb": {"num_rows": ROWS, "dim": DIM, "dtype": "float32",
                          "partitioner": {"kind": "mod", "num_shards": 2, "num_rows": ROWS}}}
        groups = {"model": {"w": torch.full((2,), float(self.step))}, "ps_tables": parts}
        return groups, {"step": self.step, "strategy": {"tables": tables}}


def run(hook: ExportHook, trainer: Trainer, clock: Clock, steps: int) -> list[list[str]]:
    """``steps`` steps 10 s apart; the exports in the directory after each."""
    seen = []
    for _ in range(steps):
        clock.now += 10
        hook.after_step(trainer.advance())
        seen.append(sorted(n for n in os.listdir(hook.out_dir) if not n.startswith(".")))
    return seen


def test_a_full_export_then_deltas_and_retention_keeps_what_the_newest_chains_need(
        tmp_path) -> None:
    clock, trainer = Clock(), Trainer()
    hook = ExportHook(tmp_path / "exports", every_secs=10, full_every=3, keep=2, clock=clock)
    hook.begin(trainer)
    seen = run(hook, trainer, clock, 8)
    assert seen[2] == ["delta-00000002", "delta-00000003", "full-00000001"]
    # at step 5 the newest two are full-4 and delta-5: the first chain is no longer needed
    assert seen[4] == ["delta-00000005", "full-00000004"]
    assert seen[5] == ["delta-00000005", "delta-00000006", "full-00000004"]
    assert seen[7] == ["delta-00000008", "full-00000007"]
    delta = read_export(tmp_path / "exports" / "delta-00000008").description
    assert delta["tables"]["emb"]["rows"] == 10  # the rows step 8 changed
    hook.end(StepContext(8, 100, None, None, 1), None)  # the step has not moved: no export
    assert len(hook.written) == 8
    trainer.advance()
    hook.end(StepContext(9, 100, None, None, 1), None)
    assert hook.last.name == "delta-00000009"
    served = serving.resolve_chain(tmp_path / "exports")  # the directory: its newest chain
    assert [e.path.name for e in served] == ["full-00000007", "delta-00000008",
                                             "delta-00000009"]


def test_no_export_before_every_secs_and_none_off_the_chief(tmp_path) -> None:
    clock, trainer = Clock(), Trainer()
    hook = ExportHook(tmp_path / "a", every_secs=25, clock=clock)
    hook.begin(trainer)
    assert [len(s) for s in run(hook, trainer, clock, 6)] == [0, 0, 1, 1, 1, 2]
    worker = Trainer()
    worker.strategy = type("W", (), {"is_chief": False})()
    quiet = ExportHook(tmp_path / "b", every_secs=1, clock=clock)
    quiet.begin(worker)
    for _ in range(2):
        clock.now += 10
        quiet.after_step(worker.advance())
    quiet.end(None, None)
    assert not (tmp_path / "b").exists()
    with pytest.raises(InvalidArgumentError, match="keep=0; give a number >= 1"):
        ExportHook(tmp_path, keep=0)


def test_a_reader_polling_the_directory_never_sees_a_partial_export(tmp_path) -> None:
    clock, trainer = Clock(), Trainer()
    out = tmp_path / "exports"
    hook = ExportHook(out, every_secs=10, full_every=2, keep=1, clock=clock)
    hook.begin(trainer)
    stop, reads, failures = threading.Event(), [], []

    def poll() -> None:
        while not stop.is_set():
            for name in os.listdir(out):
                try:
                    reads.append(read_export(out / name).step)
                except TowerflowError as exc:
                    if (out / name).exists() and not name.startswith(".tmp-"):
                        failures.append(f"{name}: {exc}")

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        run(hook, trainer, clock, 6)
    finally:
        stop.set()
        reader.join(timeout=60)
    assert not reader.is_alive()
    assert failures == [] and reads  # every export the reader found was whole


@pytest.mark.slow
def test_towerflow_train_export_dir_leaves_an_export_of_the_last_step(tmp_path) -> None:
    from towerflow.checkpoint import latest_checkpoint, read_checkpoint
    from towerflow.cli import main
    from towerflow.training.tasks import get_task

    run, exports = tmp_path / "run", tmp_path / "exports"
    assert main(["train", "click", "--table-rows", "500", "--ids-per-example", "4",
                 "--embedding-dim", "4", "--summary-every", "0", "--no-progress",
                 "--max-steps", "5", "--batch-size", "32", "--train-dir", str(run),
                 "--export-dir", str(exports)]) == 0
    assert sorted(os.listdir(exports)) == ["full-00000005"]
    sizes = {"table_rows": 500, "embedding_dim": 4, "ids_per_example": 4}
    model = serving.load(exports, get_task("click", sizes).build_model())
    saved = read_checkpoint(latest_checkpoint(run)).groups["model"]
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
