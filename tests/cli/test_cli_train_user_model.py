"""``towerflow train --model MODULE:FACTORY --data MODULE:FACTORY``: the user's own model and
data through every path of the command line (one process, ps, run.yaml, resume, eval)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from towerflow.checkpoint import CheckpointManager
from towerflow.cli import main

QUIET = ["--summary-every", "0", "--no-progress", "--log-every", "1000"]
LOSS = re.compile(r"^loss = (\d+\.\d{3})$", re.MULTILINE)

#: a regression with a planted truth (targets = x @ w), and variants of the factories
FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn
    from towerflow.strategies import OptimizerConfig

    TRUTH = torch.tensor([1.0, -2.0, 0.5, 0.0])

    def build():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def build_with_loss():
        return {"model": build(), "loss_fn": nn.MSELoss(),
                "optimizer": OptimizerConfig("adagrad", lr=0.3, initial_accumulator_value=0.01)}

    def build_with_groups():
        model = build()
        return {"model": model, "loss_fn": nn.MSELoss(), "optimizer": torch.optim.Adagrad(
            [{"params": model[0].parameters(), "lr": 0.2}, {"params": model[2].parameters()}],
            lr=0.05)}

    def batches_of_dir(split, data_dir, batch_size=8):
        import os
        assert os.path.isabs(data_dir), data_dir
        x = torch.full((batch_size, 4), float(len(os.listdir(data_dir))))
        yield x, (x @ TRUTH).unsqueeze(1)

    def batches(split, batch_size, rank, world_size, seed, epoch):
        g = torch.Generator().manual_seed(seed * 1000 + epoch * 10 + rank
                                          + (0 if split == "train" else 7))
        for _ in range(max(1, 64 // batch_size)):
            x = torch.randn(batch_size, 4, generator=g)
            yield x, (x @ TRUTH).unsqueeze(1)

    def not_a_model():
        return [nn.Linear(4, 1)]

    def no_batches(split):
        return 42

    NOT_CALLABLE = 3
''')


@pytest.fixture
def factories(tmp_path, monkeypatch) -> str:
    """A module of factories in ``tmp_path`` (importable here and by child processes);
    its name is unique to the test, so no other test's module is reused."""
    name = f"user_factories_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _env(subprocess_env: dict[str, str], where: Path) -> dict[str, str]:
    return dict(subprocess_env, PYTHONPATH=os.pathsep.join(
        [str(where), subprocess_env.get("PYTHONPATH", "")]))


def _eval_loss(capsys, run: Path) -> float:
    capsys.readouterr()
    assert main(["eval", "--train-dir", str(run), "--device", "/cpu:0"]) == 0
    out = capsys.readouterr().out
    match = LOSS.search(out)
    assert match is not None, out
    return float(match.group(1))


def test_own_model_trains_records_its_factories_resumes_and_evaluates(
        tmp_path, capsys, caplog, factories) -> None:
    run = tmp_path / "run"
    assert main(["train", "--model", f"{factories}:build", "--data", f"{factories}:batches",
                 "--loss", "mse", "--train-dir", str(run), "--max-steps", "20",
                 "--batch-size", "16", "--device", "/cpu:0", *QUIET]) == 0
    settings = yaml.safe_load((run / "run.yaml").read_text())
    assert (settings["model"], settings["data"], settings["loss"]) == (
        f"{factories}:build", f"{factories}:batches", "mse")
    manifest = json.loads((run / "ckpt-00000020" / "manifest.json").read_text())
    assert {k: manifest["metadata"][k] for k in ("task", "task_data", "task_loss")} == {
        "task": f"{factories}:build", "task_data": f"{factories}:batches", "task_loss": "mse"}
    before = _eval_loss(capsys, run)
    # the same command with a later --max-steps (and only --train-dir) resumes at step 20
    with caplog.at_level(logging.INFO, logger="towerflow"):
        assert main(["train", "--train-dir", str(run), "--max-steps", "60", "--device",
                     "/cpu:0", *QUIET]) == 0
    assert re.search(r"restored .*ckpt-00000020 at step 20", caplog.text), caplog.text
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-00000020", "ckpt-00000060"]
    after = _eval_loss(capsys, run)
    assert after < before and after < 0.5  # a constant guess scores |w|^2 = 5.25


def test_the_factory_gives_the_loss_and_the_optimizer(tmp_path, factories) -> None:
    run = tmp_path / "run"
    assert main(["train", f"{factories}:build_with_loss", "--data", f"{factories}:batches",
                 "--train-dir", str(run), "--max-steps", "5", "--batch-size", "16",
                 "--device", "/cpu:0", *QUIET]) == 0
    settings = yaml.safe_load((run / "run.yaml").read_text())
    assert (settings["optimizer"], settings["lr"], settings["initial_accumulator_value"],
            settings["loss"]) == ("adagrad", 0.3, 0.01, None)
    manifest = json.loads((run / "ckpt-00000005" / "manifest.json").read_text())
    groups = manifest["metadata"]["strategy"]["optimizer"]["tree"]["param_groups"]
    assert [(g["lr"], g["initial_accumulator_value"]) for g in groups] == [(0.3, 0.01)]


def test_the_factorys_torch_optimizer_trains_each_group_with_its_rate(tmp_path,
                                                                      factories) -> None:
    run = tmp_path / "run"
    assert main(["train", f"{factories}:build_with_groups", "--data", f"{factories}:batches",
                 "--train-dir", str(run), "--max-steps", "3", "--batch-size", "16",
                 "--device", "/cpu:0", *QUIET]) == 0
    settings = yaml.safe_load((run / "run.yaml").read_text())
    assert (settings["optimizer"], settings["lr"]) == ("adagrad", 0.05)
    manifest = json.loads((run / "ckpt-00000003" / "manifest.json").read_text())
    groups = manifest["metadata"]["strategy"]["optimizer"]["tree"]["param_groups"]
    assert sorted((g["lr"], len(g["params"])) for g in groups) == [(0.05, 2), (0.2, 2)]


def test_the_data_factory_takes_only_the_keywords_it_names(tmp_path, factories) -> None:
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "one").write_text("1")
    run = tmp_path / "run"
    assert main(["train", f"{factories}:build", "--data", f"{factories}:batches_of_dir",
                 "--loss", "mse", "--data-dir", str(tmp_path / "files"), "--train-dir",
                 str(run), "--max-steps", "2", "--device", "/cpu:0", *QUIET]) == 0
    settings = yaml.safe_load((run / "run.yaml").read_text())
    assert settings["data_dir"] == str(tmp_path / "files")


@pytest.mark.slow
def test_own_model_on_1_ps_and_2_workers_resumes_and_evaluates(
        tmp_path, capsys, factories, subprocess_env, python) -> None:
    run = tmp_path / "run"
    cmd = [python, "-m", "towerflow", "train", "--model", f"{factories}:build", "--data",
           f"{factories}:batches", "--loss", "mse", "--ps", "1", "--workers", "2",
           "--train-dir", str(run), "--max-steps", "20", "--batch-size", "16", *QUIET]
    env = _env(subprocess_env, tmp_path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "worker:1 exited with status 0" in said and "ps shard 0 initialised" in said
    assert yaml.safe_load((run / "run.yaml").read_text())["ps"] == 1
    before = _eval_loss(capsys, run)
    # resumed from its record alone: the factories come from run.yaml
    proc = subprocess.run([python, "-m", "towerflow", "train", "--train-dir", str(run),
                           "--max-steps", "60"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # async: the other worker's last push may carry the global step past --max-steps
    restored = re.search(r"restored .*ckpt-(\d+)", proc.stdout + proc.stderr)
    assert restored and 20 <= int(restored.group(1)) <= 22, proc.stdout + proc.stderr
    latest = CheckpointManager(run).latest()
    assert latest is not None and int(latest.name.rsplit("-", 1)[1]) >= 60
    # trained, and still trained after the resume: the targets' variance (an untrained
    # model's loss) is about 5.25; async steps of two workers need not lower it monotonically
    assert before < 1.0 and _eval_loss(capsys, run) < 1.0


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "no_such_module_x:build", "--data", "{m}:batches", "--loss", "mse"],
     r"--model 'no_such_module_x:build': no module named 'no_such_module_x' on the Python path "
     r".*; run from its directory or add that directory to PYTHONPATH\."),
    (["--model", "{m}:nothere", "--data", "{m}:batches", "--loss", "mse"],
     r"--model '{m}:nothere': module '{m}' has no attribute 'nothere'; name one of its "
     r"callables \(.*, build, build_with_groups, .*\)\."),
    (["--model", "{m}:NOT_CALLABLE", "--data", "{m}:batches", "--loss", "mse"],
     r"--model '{m}:NOT_CALLABLE' is a int, not a callable; name the function"),
    (["--model", "{m}:not_a_model", "--data", "{m}:batches", "--loss", "mse"],
     r"--model {m}:not_a_model returned a list, not a torch\.nn\.Module; return the model"),
    (["--model", "{m}:build", "--data", "{m}:no_batches", "--loss", "mse"],
     r"--data {m}:no_batches returned a int for split 'train', not an iterable of \(inputs, "
     r"targets\) batches; return a list, a generator or a DataLoader\."),
    (["--model", "{m}:build", "--loss", "mse"],
     r"--model {m}:build needs its data as a factory too, not --data real; pass --data "
     r"MODULE:FACTORY"),
    (["--model", "{m}:build", "--data", "{m}:batches"],
     r"--model {m}:build gives no loss; pass --loss \(mse, cross_entropy, bce_with_logits\), "
     r"or return \{'model': model, 'loss_fn': criterion\} from the factory\."),
    (["--model", "{m}:build_with_loss", "--data", "{m}:batches", "--lr", "0.1"],
     r"--model {m}:build_with_loss returns its own optimizer and the command line sets --lr "
     r"too; drop those flags, or return no 'optimizer' from the factory\."),
    (["digits", "--data", "{m}:batches"],
     r"--data {m}:batches is the data of your own model, not of digits; remove it, or train "
     r"your model with --model MODULE:FACTORY\."),
    (["digits", "--loss", "mse"], r"--loss mse applies to the MODULE:FACTORY model only"),
])
def test_a_bad_factory_is_one_sentence_naming_it(tmp_path, capsys, factories, argv,
                                                 message) -> None:
    argv = [a.replace("{m}", factories) for a in argv]
    code = main(["train", *argv, "--train-dir", str(tmp_path / "run"), "--max-steps", "2",
                 "--batch-size", "16", "--device", "/cpu:0", *QUIET])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(message.replace("{m}", factories), err), err
    assert not (tmp_path / "run" / "ckpt-00000002").exists()


def test_a_model_that_is_neither_built_in_nor_a_factory_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "mymodels", "--max-steps", "1"])
    assert exit_.value.code == 2
    assert re.search(r"argument --model: 'mymodels' is neither a built-in model \(cifar10, "
                     r"digits, .*\) nor MODULE:FACTORY such as mymodels:build",
                     capsys.readouterr().err)
