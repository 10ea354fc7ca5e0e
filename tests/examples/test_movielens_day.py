"""The MovieLens day, as docs/recommendation.md walks it: GroupLens files, ``towerflow train
movielens --ps 2 --workers 2``, ``towerflow eval``, ``towerflow export``, and
``towerflow.serving.load`` predicting the test split exactly as the trained model does."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
from recsys_files import write_ml100k

import towerflow
from towerflow.checkpoint import latest_checkpoint, load_into_module, read_checkpoint
from towerflow.training.evaluate import data_options_from, table_weights
from towerflow.training.runconfig import load_run_settings
from towerflow.training.tasks import get_task

AUC = re.compile(r"^AUC = (\d\.\d{3})$", re.MULTILINE)


def _towerflow(python: str, env: dict[str, str], *args: str, timeout: float = 240
               ) -> tuple[str, str]:
    proc = subprocess.run([python, "-m", "towerflow", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, proc.stderr


@torch.no_grad()
def _predictions(model: torch.nn.Module, test) -> torch.Tensor:  # type: ignore[no-untyped-def]
    model.eval()
    out = []
    for start in range(0, len(test), 64):
        fields, dense, _ = test.batch(slice(start, start + 64))
        out.append(model(fields, dense))
    return torch.cat(out)


@pytest.mark.slow
def test_the_movielens_day_train_eval_export_serve(tmp_path, subprocess_env, python) -> None:
    data, run, export = tmp_path / "data", tmp_path / "run", tmp_path / "export"
    write_ml100k(data / "ml-100k")  # u.data, u.user, u.item: even users like even movies
    said = "".join(_towerflow(python, subprocess_env, "train", "movielens", "--ps", "2",
                              "--workers", "2", "--data-dir", str(data), "--train-dir", str(run),
                              "--max-steps", "60", "--batch-size", "64", "--summary-every", "0",
                              "--no-progress"))
    # the model's sparse=True tables are small: each travels whole, and says so
    for table in ("embeddings.0", "embeddings.1"):
        assert re.search(rf"\[worker:0\] .*'{re.escape(table)}' [\d,]+ x \d+ \(.+\) -> whole "
                         rf"with the dense variables: sparse=True, but under", said), said[-3000:]
    assert "-> rows on" not in said, said[-3000:]
    printed = AUC.search(_towerflow(python, subprocess_env, "eval", "--train-dir", str(run),
                                    "--device", "/cpu:0")[0])
    assert printed is not None and float(printed.group(1)) > 0.75
    _towerflow(python, subprocess_env, "export", "--train-dir", str(run), "--out", str(export))

    settings = load_run_settings(run)
    task = get_task("movielens", settings)
    served = towerflow.serving.load(export, task.build_model())
    ckpt = read_checkpoint(latest_checkpoint(run))  # the trained model, as eval reads it
    trained = task.build_model()
    load_into_module(trained, {**ckpt.groups["model"], **table_weights(ckpt, trained)})
    test = task.load("test", data_options_from(settings))
    served_out, trained_out = _predictions(served, test), _predictions(trained, test)
    assert served_out.shape == (len(test),) and not served_out.requires_grad
    assert torch.equal(served_out, trained_out)
    scores = task.scores(served, test, device=torch.device("cpu"), batch_size=64)
    assert f"{scores['AUC']:.3f}" == printed.group(1)
