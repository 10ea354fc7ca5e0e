"""The training loop: step log, summaries, checkpoints, resume, NaN guard, smoke runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cifar10_files import write_tiny_cifar10

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.data import load_digits
from towerflow.models import DigitsNet, cross_entropy_loss
from towerflow.strategies.base import OptimizerConfig
from towerflow.strategies.single import SingleDevice
from towerflow.training import ExponentialDecay, TrainConfig, Trainer, run_training
from towerflow.training.hooks import NanLossDuringTrainingError
from towerflow.training.tasks import DataOptions

STEP_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}: "
    r"step (\d+), loss = \d+\.\d\d \((\d+\.\d) examples/sec; (\d+\.\d{3}) sec/batch\)$")


@pytest.fixture(scope="module")
def digits():
    return load_digits("train")


def _trainer(digits, train_dir: Path | None, *, seed: int = 0, loss_fn=cross_entropy_loss,
             lr: float = 0.1, **options) -> Trainer:
    torch.manual_seed(seed)
    config = TrainConfig(train_dir=train_dir, batch_size=16, log_every=10 ** 6, **options)
    return Trainer(DigitsNet(), loss_fn, digits, strategy=SingleDevice("/cpu:0"),
                   optimizer=OptimizerConfig("momentum", lr=lr, momentum=0.9),
                   schedule=ExponentialDecay(lr, decay_steps=3, decay_rate=0.5),
                   config=config.replace(ema_decay=0.99))


def test_step_log_has_the_article_format_and_counts_the_batch(digits, capsys) -> None:
    with Trainer(DigitsNet(), cross_entropy_loss, digits, strategy=SingleDevice("/cpu:0"),
                 config=TrainConfig(max_steps=20, batch_size=16, log_every=5)) as trainer:
        result = trainer.fit()
    lines = capsys.readouterr().out.splitlines()
    matches = [STEP_LINE.match(line) for line in lines]
    assert all(matches), lines
    assert [int(m.group(1)) for m in matches] == [5, 10, 15, 20]
    for m in matches:
        examples_per_sec, sec_per_batch = float(m.group(2)), float(m.group(3))
        if sec_per_batch >= 0.01:
            assert examples_per_sec == pytest.approx(16 / sec_per_batch, rel=0.1)
    assert result.step == 20 and result.loss is not None


def test_checkpoints_every_n_steps_and_at_the_last_one_with_all_groups(digits, tmp_path) -> None:
    with _trainer(digits, tmp_path, max_steps=7, checkpoint_every=3, summary_every=0) as t:
        t.fit()
    names = [p.name for p in CheckpointManager(tmp_path).checkpoints()]
    assert names == ["ckpt-00000003", "ckpt-00000006", "ckpt-00000007"]
    ckpt = read_checkpoint(tmp_path / "ckpt-00000007")
    assert set(ckpt.groups) == {"model", "optimizer", "ema"}
    assert set(ckpt.groups["ema"]) == set(ckpt.groups["model"])
    meta = ckpt.metadata
    assert meta["step"] == 7 and meta["schedule"]["decay_steps"] == 3
    assert meta["data"] == {"epoch": 0, "offset": 7}


def test_resume_gives_the_state_of_an_uninterrupted_run(digits, tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with _trainer(digits, straight, max_steps=8, checkpoint_every=4, summary_every=0) as t:
        t.fit()
    with _trainer(digits, resumed, max_steps=4, checkpoint_every=4, summary_every=0) as t:
        t.fit()
    # a different initialisation: everything must come from the checkpoint
    with _trainer(digits, resumed, seed=123, max_steps=8, checkpoint_every=4,
                  summary_every=0) as t:
        result = t.fit()
    assert result.restored_from == 4 and result.step == 8
    a = read_checkpoint(straight / "ckpt-00000008")
    b = read_checkpoint(resumed / "ckpt-00000008")
    assert a.metadata["data"] == b.metadata["data"]
    assert a.metadata["strategy"]["global_step"] == b.metadata["strategy"]["global_step"] == 8
    for group in ("model", "optimizer", "ema"):
        assert set(a.groups[group]) == set(b.groups[group])
        for name, tensor in a.groups[group].items():
            torch.testing.assert_close(b.groups[group][name], tensor, rtol=0, atol=0)


def _nan_after(k: int):
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = cross_entropy_loss(model, batch)
        return loss * float("nan") if calls["n"] > k else loss

    return loss_fn


@pytest.mark.parametrize(("log_every", "checkpoint_every", "last_good"), [(3, 2, 4), (10 ** 6, 3, 3)])
def test_nan_loss_stops_training_and_leaves_only_finite_checkpoints(
        digits, tmp_path, log_every, checkpoint_every, last_good) -> None:
    trainer = _trainer(digits, tmp_path, loss_fn=_nan_after(4), max_steps=50,
                       checkpoint_every=checkpoint_every, summary_every=0)
    trainer.config = trainer.config.replace(log_every=log_every)
    with trainer, pytest.raises(NanLossDuringTrainingError,
                                match=r"Model diverged with loss = NaN at step 5 "):
        trainer.fit()
    manager = CheckpointManager(tmp_path)
    assert manager.latest().name == f"ckpt-{last_good:08d}"
    for path in manager.checkpoints():
        for tensors in read_checkpoint(path).groups.values():
            assert all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_parameters_overflowing_with_a_huge_learning_rate_are_never_checkpointed(tmp_path) -> None:
    model = torch.nn.Linear(4, 1)
    batches = [(torch.full((8, 4), 100.0), torch.full((8, 1), -100.0))]
    trainer = Trainer(model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), batches,
                      strategy=SingleDevice("/cpu:0"), optimizer=OptimizerConfig(lr=1e38),
                      train_dir=tmp_path, max_steps=5, checkpoint_every=1, log_every=10 ** 6,
                      summary_every=0)
    with trainer, pytest.raises(NanLossDuringTrainingError,
                                match=r"Model diverged with loss = NaN: (weight|bias) is not finite"):
        trainer.fit()
    assert CheckpointManager(tmp_path).checkpoints() == []


def test_summaries_are_tensorboard_events_with_scalars_and_histograms(digits, tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _trainer(digits, tmp_path, max_steps=4, summary_every=2, checkpoint_every=0) as t:
        t.fit()
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert {"loss", "learning_rate", "examples_per_sec"} <= set(tags["scalars"])
    assert {"hidden.weight", "hidden.weight/gradients"} <= set(tags["histograms"])
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    assert [e.value for e in events.Scalars("learning_rate")] == pytest.approx([0.1, 0.05])


def test_an_iterable_of_batches_is_restarted_when_it_runs_out() -> None:
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    model = torch.nn.Linear(3, 1)
    trainer = Trainer(model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), batches,
                      strategy=SingleDevice("/cpu:0"), max_steps=5, log_every=5, ema_decay=None)
    with trainer:
        result = trainer.fit()
    assert result.step == 5 and result.loss is not None


def test_unknown_training_option_is_refused_with_the_known_ones() -> None:
    with pytest.raises(Exception, match=r"Unknown training option\(s\) max_step; known options:"):
        Trainer(torch.nn.Linear(1, 1), cross_entropy_loss, [], strategy=SingleDevice("/cpu:0"),
                max_step=3)


def test_cifar10_trains_on_synthetic_data(tmp_path) -> None:
    result = run_training("cifar10", TrainConfig(train_dir=tmp_path, max_steps=2, batch_size=4,
                                                 log_every=1, summary_every=0),
                          data=DataOptions(synthetic=True, synthetic_examples=16),
                          strategy=SingleDevice("/cpu:0"))
    # cross entropy ~2.30 plus the initial weight decay ~2.38: article 001's first line
    # reads "step 0, loss = 4.68"
    assert result.step == 2 and result.loss == pytest.approx(4.68, abs=0.3)
    ckpt = read_checkpoint(tmp_path / "ckpt-00000002")
    assert ckpt.groups["model"]["local3.weight"].shape == (384, 2304)
    assert ckpt.metadata["task"] == "cifar10"


def test_cifar10_trains_on_binary_files(tmp_path) -> None:
    write_tiny_cifar10(tmp_path / "data")
    result = run_training("cifar10", TrainConfig(train_dir=tmp_path / "run", max_steps=3,
                                                 batch_size=4, log_every=3, summary_every=0),
                          data=DataOptions(data_dir=tmp_path / "data", download=False),
                          strategy=SingleDevice("/cpu:0"))
    assert result.step == 3
    assert read_checkpoint(tmp_path / "run" / "ckpt-00000003").metadata["data"] == {
        "epoch": 0, "offset": 3}
