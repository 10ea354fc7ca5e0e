"""A user's own model like a built-in task: ``towerflow eval`` reports the metrics its loss
implies (and the factory's own), and a resumed run's data factory continues at its position."""

from __future__ import annotations

import json
import logging
import re
import sys
import textwrap

import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from towerflow.cli import main
from towerflow.errors import InvalidArgumentError
from towerflow.training.taskbase import DataOptions
from towerflow.training.user_task import UserTask

QUIET = ["--summary-every", "0", "--no-progress", "--log-every", "1000", "--device", "/cpu:0"]

#: a click model (logits, BCE) and a 3-class classifier, with data that says which batch it is
FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn

    SEEN = []   # (epoch, batch index) of every training batch given, in order
    W = torch.tensor([1.5, -2.0, 0.5, 1.0])

    def clicks():
        return {"model": nn.Linear(4, 1), "loss_fn": nn.BCEWithLogitsLoss(),
                "metrics": {"positives": lambda outputs, targets: float(targets.sum())}}

    def classes():
        return nn.Linear(4, 3)

    def _batch(split, epoch, index, batch_size=32):
        g = torch.Generator().manual_seed(epoch * 1000 + index + (500 if split == "test" else 0))
        x = torch.randn(batch_size, 4, generator=g)
        if split == "train":
            SEEN.append((epoch, index))
        return x, (x @ W > 0).float().unsqueeze(1)

    def click_data(split, epoch):
        for index in range(8):
            yield _batch(split, epoch, index)

    def class_data(split, epoch):
        for index in range(8):
            x, _ = _batch(split, epoch, index)
            yield x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()

    def skipping_data(split, epoch, skip=0):
        for index in range(skip, 8):
            yield _batch(split, epoch, index)

    class Stateful:
        """An iterable that says where it is, as torchdata's StatefulDataLoader."""
        def __init__(self, split, epoch, bad=False, start=0):
            self.split, self.epoch, self.next, self.bad = split, epoch, 0, bad
            self.start = start  # its state counts from here
        def __iter__(self):
            while self.start + self.next < 8:
                self.next += 1
                yield _batch(self.split, self.epoch, self.start + self.next - 1)
        def state_dict(self):
            return {"next": torch.tensor(self.next)} if self.bad else {"next": self.next}
        def load_state_dict(self, state):
            self.next = state["next"]

    def stateful_data(split, epoch):
        return Stateful(split, epoch)

    def stateful_skipping_data(split, epoch, skip=0):
        """Names skip and returns a stateful iterable counting from it: its state alone places
        it on resume (skip and the state together would skip the batches twice)."""
        return Stateful(split, epoch, start=skip)

    def bad_state_data(split, epoch):
        return Stateful(split, epoch, bad=True)
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module of factories in ``tmp_path``, importable here; unique to the test."""
    name = f"own_task_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    yield sys.modules[name]
    sys.modules.pop(name, None)


def _eval(capsys, run) -> dict[str, float]:
    capsys.readouterr()
    assert main(["eval", "--train-dir", str(run), "--device", "/cpu:0"]) == 0
    return {m[0]: float(m[1]) for m in re.findall(r"^(\w+) = ([\d.]+)$", capsys.readouterr().out,
                                                  re.MULTILINE)}


def test_eval_of_a_binary_cross_entropy_reports_auc_logloss_and_the_factorys_metric(
        tmp_path, capsys, factories) -> None:
    run = tmp_path / "run"
    assert main(["train", "--model", f"{factories.__name__}:clicks", "--data",
                 f"{factories.__name__}:click_data", "--train-dir", str(run), "--max-steps", "40",
                 "--optimizer", "adagrad", "--lr", "0.3", *QUIET]) == 0
    printed = _eval(capsys, run)
    assert set(printed) == {"loss", "AUC", "logloss", "positives"}
    # the same numbers from the checkpoint's model, by scikit-learn directly
    task = UserTask(f"{factories.__name__}:clicks", f"{factories.__name__}:click_data")
    model = task.build_model()
    from towerflow.checkpoint import CheckpointManager, load_into_module

    load_into_module(model, CheckpointManager(run).restore().groups["model"])
    batches = list(factories.click_data("test", 0))
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with torch.no_grad():
        p = torch.sigmoid(model(x)).double().numpy().ravel()
    assert printed["AUC"] == pytest.approx(roc_auc_score(y.numpy().ravel(), p), abs=1e-4)
    assert printed["logloss"] == pytest.approx(log_loss(y.numpy().ravel(), p), abs=1e-4)
    assert printed["positives"] == float(y.sum()) and printed["AUC"] > 0.9


def test_eval_of_a_cross_entropy_reports_accuracy(tmp_path, capsys, factories) -> None:
    run = tmp_path / "run"
    assert main(["train", "--model", f"{factories.__name__}:classes", "--data",
                 f"{factories.__name__}:class_data", "--loss", "cross_entropy",
                 "--train-dir", str(run), "--max-steps", "60", "--lr", "0.5", *QUIET]) == 0
    printed = _eval(capsys, run)
    assert set(printed) == {"loss", "accuracy"} and 0.7 < printed["accuracy"] <= 1.0


@pytest.mark.parametrize("data", ["click_data", "skipping_data", "stateful_data",
                                  "stateful_skipping_data"])
def test_a_resumed_run_continues_the_data_at_its_position(tmp_path, caplog, factories,
                                                          data) -> None:
    run = tmp_path / "run"
    common = ["--model", f"{factories.__name__}:clicks", "--data", f"{factories.__name__}:{data}",
              "--train-dir", str(run), *QUIET]
    assert main(["train", *common, "--max-steps", "11"]) == 0
    manifest = json.loads((run / "ckpt-00000011" / "manifest.json").read_text())
    position = manifest["metadata"]["data"]
    assert (position["epoch"], position["batch"]) == (1, 3)  # 8 batches an epoch
    assert ("iterable" in position) == data.startswith("stateful")
    first = list(factories.SEEN)
    factories.SEEN.clear()
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        assert main(["train", *common, "--max-steps", "14"]) == 0
    # the second run gives batches 3, 4, 5 of epoch 1: the first run's stream, continued
    assert first[:11] == [(e, i) for e in (0, 1) for i in range(8)][:11]
    given = [seen for seen in factories.SEEN if seen >= (1, 3)]
    assert given[:3] == [(1, 3), (1, 4), (1, 5)]
    dropped = "reading and dropping" in caplog.text
    assert dropped == (data == "click_data")  # said, where towerflow reads the batches again


def test_a_position_that_is_not_json_is_one_sentence_and_nothing_trains(
        tmp_path, capsys, factories) -> None:
    run = tmp_path / "run"
    assert main(["train", "--model", f"{factories.__name__}:clicks", "--data",
                 f"{factories.__name__}:bad_state_data", "--train-dir", str(run),
                 "--max-steps", "5", *QUIET]) != 0
    err = capsys.readouterr().err
    assert "state_dict() is not JSON" in err and "bad_state_data" in err
    assert factories.SEEN == [] and not list(run.glob("ckpt-*"))


def test_a_position_of_another_data_source_is_refused_with_the_way_out(factories) -> None:
    task = UserTask(f"{factories.__name__}:clicks", f"{factories.__name__}:click_data")
    data = task.load("train", DataOptions(data_dir="."))
    with pytest.raises(InvalidArgumentError, match=r"not a position of --data .*new --train-dir"):
        data.load_state({"offset": 3})
