"""``towerflow eval``: precision @ 1 of the moving averages, on the CPU; no checkpoint."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

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
    from cifar10_files import write_tiny_cifar10

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


def _train_cifar10(run: Path, *data_flags: str) -> None:
    argv = ["train", "cifar10", "--train-dir", str(run), "--max-steps", "1", "--batch-size", "4",
            "--device", "/cpu:0", "--summary-every", "0", "--no-progress", *data_flags]
    assert main(argv) == 0


def test_eval_reads_the_test_split_of_the_data_the_run_trained_on(tmp_path, capsys,
                                                                  monkeypatch) -> None:
    from cifar10_files import write_tiny_cifar10

    write_tiny_cifar10(tmp_path / "data", per_file=3)
    monkeypatch.chdir(tmp_path)  # a relative --data-dir, evaluated from elsewhere later
    _train_cifar10(tmp_path / "run", "--data_dir", "data", "--no-download")
    monkeypatch.chdir(tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", "cifar10", "--train-dir", str(tmp_path / "run"),
                 "--device", "/cpu:0"]) == 0
    out = capsys.readouterr().out
    assert "on 3 test examples" in out and PRECISION.search(out), out


def test_eval_of_a_synthetic_run_uses_synthetic_data_and_flags_override_it(tmp_path,
                                                                           capsys) -> None:
    run = tmp_path / "run"
    _train_cifar10(run, "--data", "synthetic", "--synthetic-examples", "12",
                   "--data-dir", str(tmp_path / "nowhere"), "--no-download")
    saved = yaml.safe_load((run / "run.yaml").read_text())
    assert saved["data"] == "synthetic" and saved["synthetic_examples"] == 12
    capsys.readouterr()
    base = ["eval", "cifar10", "--train-dir", str(run), "--device", "/cpu:0"]
    assert main(base) == 0
    assert "on 12 test examples" in capsys.readouterr().out
    assert main([*base, "--synthetic-examples", "5"]) == 0
    assert "on 5 test examples" in capsys.readouterr().out
    # real data named on the command line wins over the recorded synthetic setting
    assert main([*base, "--data", "real"]) == 2
    assert "test_batch.bin are not in" in capsys.readouterr().err


def test_a_damaged_data_record_is_named(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    _train_cifar10(run, "--data", "synthetic", "--synthetic-examples", "4")
    (run / "run.yaml").write_text("[1, 2]")
    assert main(["eval", "cifar10", "--train-dir", str(run), "--device", "/cpu:0"]) == 2
    assert re.search(r"run\.yaml' does not hold a run's settings .* delete it",
                     capsys.readouterr().err)


def _digits_run(train_dir, steps: int = 4, every: int = 2) -> None:
    run_training("digits", TrainConfig(train_dir=train_dir, max_steps=steps, batch_size=32,
                                       log_every=10 ** 6, summary_every=0,
                                       checkpoint_every=every),
                 strategy=SingleDevice("/cpu:0"))


def _eval_in_a_child(train_dir, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``python -m towerflow eval digits`` on ``train_dir``, killed if it outlives ``timeout``."""
    return subprocess.run(
        [sys.executable, "-m", "towerflow", "eval", "digits", "--train-dir", str(train_dir),
         "--device", "cpu"], capture_output=True, text=True, timeout=timeout)


def _nest_manifest(ckpt, depth: int) -> None:
    manifest = ckpt / "manifest.json"
    text = manifest.read_text().replace('"metadata": {', '"metadata": {"deep": '
                                        + "[" * depth + "]" * depth + ", ", 1)
    manifest.write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    (ckpt / "manifest.sha256").write_text(f"{digest}  manifest.json\n")


def test_eval_of_a_manifest_nested_100000_deep_falls_back_or_says_what_is_damaged(
    tmp_path, capsys, caplog
) -> None:
    _digits_run(tmp_path)
    _nest_manifest(tmp_path / "ckpt-00000004", 100_000)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        assert main(["eval", "digits", "--train-dir", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "step 2:" in out and PRECISION.search(out)
    assert re.search(r"ckpt-00000004/manifest\.json' is nested deeper than 64 levels",
                     caplog.text)
    _nest_manifest(tmp_path / "ckpt-00000002", 100_000)
    proc = _eval_in_a_child(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "RecursionError" not in proc.stderr and "Traceback" not in proc.stderr
    assert re.search(r"towerflow eval: error: Every checkpoint in .* is damaged: "
                     r"ckpt-00000004 \(.*nested deeper.*ckpt-00000002 \(", proc.stderr)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_eval_with_a_fifo_in_place_of_the_model_file_never_blocks(tmp_path) -> None:
    _digits_run(tmp_path, steps=2)
    model_file = tmp_path / "ckpt-00000002" / "model.safetensors"
    model_file.unlink()
    os.mkfifo(model_file)
    proc = _eval_in_a_child(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"model\.safetensors' is a FIFO, not a regular file", proc.stderr)
