"""``towerflow train movielens|criteo`` / ``towerflow eval``: DeepFM on the publishers' files."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import yaml
from recsys_files import write_criteo, write_ml100k

from towerflow.cli import main

QUIET = ["--summary-every", "0", "--checkpoint-every", "0", "--no-progress", "--device",
         "/cpu:0", "--log-every", "1000"]
AUC = re.compile(r"^AUC = (\d\.\d{3})$", re.MULTILINE)
LOGLOSS = re.compile(r"^logloss = (\d+\.\d{4})$", re.MULTILINE)


@pytest.fixture
def one_thread():
    """Train on one thread, as a launched process does (the tests' host has few cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _metrics(out: str) -> tuple[float, float]:
    auc, logloss = AUC.search(out), LOGLOSS.search(out)
    assert auc is not None and logloss is not None, out
    return float(auc.group(1)), float(logloss.group(1))


@pytest.mark.slow
def test_movielens_learns_the_planted_taste_and_eval_prints_auc_and_logloss(
        tmp_path, capsys, one_thread) -> None:
    write_ml100k(tmp_path / "data" / "ml-100k")  # even users like even movies
    run = tmp_path / "run"
    assert main(["train", "movielens", "--data-dir", str(tmp_path / "data"), "--train-dir",
                 str(run), "--max-steps", "120", "--batch-size", "64", *QUIET]) == 0
    settings = yaml.safe_load((run / "run.yaml").read_text())
    assert {k: settings[k] for k in ("model", "movielens_variant", "optimizer", "embedding_dim",
                                     "ema_decay", "no_download")} == {
        "model": "movielens", "movielens_variant": "ml-100k", "optimizer": "adagrad",
        "embedding_dim": 16, "ema_decay": 0.0, "no_download": False}
    capsys.readouterr()
    assert main(["eval", "--train-dir", str(run), "--device", "/cpu:0"]) == 0
    out = capsys.readouterr().out
    assert "on 400 test examples" in out
    auc, logloss = _metrics(out)
    assert auc > 0.75, out  # a trivial model scores 0.5
    assert 0 < logloss < 0.69, out  # below a constant guess of one half


@pytest.mark.slow
def test_criteo_trains_from_the_gzipped_logs_and_eval_prints_auc_and_logloss(
        tmp_path, capsys, one_thread) -> None:
    write_criteo(tmp_path / "dac", 400, gz=True)
    run = tmp_path / "run"
    assert main(["train", "criteo", "--data-dir", str(tmp_path), "--train-dir", str(run),
                 "--max-steps", "5", "--batch-size", "32", "--criteo-buckets", "100",
                 *QUIET]) == 0
    capsys.readouterr()
    assert main(["eval", "criteo", "--train-dir", str(run), "--device", "/cpu:0"]) == 0
    out = capsys.readouterr().out
    assert "on 40 test examples" in out
    auc, logloss = _metrics(out)
    assert 0.0 <= auc <= 1.0 and logloss > 0


def test_a_recommendation_option_of_another_model_is_refused(tmp_path, capsys) -> None:
    assert main(["train", "digits", "--movielens-variant", "ml-1m", "--train-dir",
                 str(tmp_path / "run"), "--max-steps", "1", *QUIET]) == 2
    assert re.search(r"--movielens-variant ml-1m applies to the movielens model only, not "
                     "digits", capsys.readouterr().err)


def test_missing_movielens_with_no_download_names_the_archive(tmp_path, capsys) -> None:
    assert main(["train", "movielens", "--data-dir", str(tmp_path / "empty"), "--no-download",
                 "--train-dir", str(tmp_path / "run"), "--max-steps", "1", *QUIET]) == 2
    err = capsys.readouterr().err
    assert "MovieLens ml-100k files u.data, u.user, u.item are not in" in err
    assert "https://files.grouplens.org/datasets/movielens/ml-100k.zip" in err


@pytest.mark.slow
def test_a_failed_movielens_download_is_one_line(tmp_path, free_ports, subprocess_env,
                                                 python) -> None:
    closed = free_ports(1)[0]  # every request goes through a proxy that is not there
    env = dict(subprocess_env, https_proxy=f"http://127.0.0.1:{closed}",
               HTTPS_PROXY=f"http://127.0.0.1:{closed}", no_proxy="", NO_PROXY="")
    cmd = [python, "-m", "towerflow", "train", "movielens", "--data-dir", str(tmp_path / "data"),
           "--train-dir", str(tmp_path / "run"), "--max-steps", "1", *QUIET]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "Cannot download MovieLens ml-100k from https://files.grouplens.org" in errors[0]
    assert "--no-download" in errors[0] and "Traceback" not in proc.stderr
