"""``towerflow eval``: precision @ 1 of the moving averages, on the CPU; no checkpoint."""

from __future__ import annotations

import re

import pytest
import torch

from towerflow.checkpoint import latest_checkpoint, load_into_module, read_checkpoint
from towerflow.cli import main
from towerflow.data import load_digits
from towerflow.models import DigitsNet
from towerflow.strategies.single import SingleDevice
from towerflow.training import TrainConfig, run_training
from towerflow.training.tasks import DataOptions

PRECISION = re.compile(r"^precision @ 1 = (\d\.\d{3})$", re.MULTILINE)


def test_eval_prints_the_precision_of_the_moving_averages_on_the_cpu(tmp_path, capsys) -> None:
    run_training("digits", TrainConfig(train_dir=tmp_path, max_steps=30, batch_size=32,
                                       log_every=10 ** 6, summary_every=0, ema_decay=0.9),
                 strategy=SingleDevice("/cpu:0"))
    capsys.readouterr()
    assert main(["eval", "digits", "--train-dir", str(tmp_path), "--device", "/cpu:0"]) == 0
    printed = float(PRECISION.search(capsys.readouterr().out).group(1))
    # the same figure computed by hand from the checkpoint's "ema" group
    ckpt = read_checkpoint(latest_checkpoint(tmp_path))
    model = DigitsNet()
    load_into_module(model, ckpt.groups["ema"])
    test = load_digits("test")
    with torch.no_grad():
        expected = (model(test.images).argmax(1) == test.labels).float().mean().item()
    assert printed == pytest.approx(expected, abs=5e-4)
    assert ckpt.groups["ema"]["hidden.weight"].ne(ckpt.groups["model"]["hidden.weight"]).any()


def test_eval_without_a_checkpoint_fails_naming_the_directory(tmp_path, capsys) -> None:
    missing = tmp_path / "never-trained"
    assert main(["eval", "digits", "--train-dir", str(missing)]) != 0
    err = capsys.readouterr().err
    assert f"No checkpoint found in '{missing}'" in err
    assert not missing.exists()


def test_eval_of_cifar10_reads_the_binary_test_file(tmp_path, capsys) -> None:
    from test_trainer import write_tiny_cifar10

    write_tiny_cifar10(tmp_path / "data")
    run_training("cifar10", TrainConfig(train_dir=tmp_path / "run", max_steps=1, batch_size=4,
                                        log_every=10 ** 6, summary_every=0),
                 data=DataOptions(data_dir=tmp_path / "data", download=False),
                 strategy=SingleDevice("/cpu:0"))
    capsys.readouterr()
    argv = ["eval", "cifar10", "--train-dir", str(tmp_path / "run"), "--device", "/cpu:0",
            "--data-dir", str(tmp_path / "data"), "--no-download"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 4 test examples" in out and PRECISION.search(out)


@pytest.mark.gpu
def test_a_checkpoint_trained_on_a_gpu_evaluates_on_the_cpu(tmp_path, capsys) -> None:
    run_training("digits", TrainConfig(train_dir=tmp_path, max_steps=10, batch_size=32,
                                       log_every=10 ** 6, summary_every=0),
                 strategy=SingleDevice("/gpu:0"))
    capsys.readouterr()
    assert main(["eval", "digits", "--train-dir", str(tmp_path), "--device", "/cpu:0"]) == 0
    assert PRECISION.search(capsys.readouterr().out)
