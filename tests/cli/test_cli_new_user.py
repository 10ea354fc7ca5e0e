"""The path a new user walks on the command line and in the docs: names that exist, one
sentence for a wrong flag, model or directory, the sentence before the usage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import towerflow.models
from towerflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_an_abbreviated_option_is_refused_not_taken_for_the_long_one(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["train", "digits", "--max-step", "5"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "towerflow: error: unrecognized arguments: --max-step 5"
    assert "usage: " in err


def test_a_wrong_model_name_is_the_first_line_and_the_usage_comes_after(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "nosuchmodel"])
    lines = capsys.readouterr().err.splitlines()
    assert re.match(r"towerflow train: error: argument model: 'nosuchmodel' is neither a "
                    r"built-in model \(.*digits.*\) nor MODULE:FACTORY", lines[0]), lines[:3]
    assert lines[2].startswith("usage: towerflow train")


@pytest.mark.parametrize("kind", ["file", "under a file", "fifo"])
def test_a_train_dir_that_cannot_be_a_directory_is_one_sentence_and_changes_nothing(
        tmp_path, capsys, kind) -> None:
    blocker = tmp_path / "runs"
    if kind == "fifo":
        os.mkfifo(blocker)
    else:
        blocker.write_text("my notes\n")
    train_dir = blocker / "digits" if kind == "under a file" else blocker
    code = main(["train", "digits", "--train-dir", str(train_dir), "--max-steps", "2"])
    err = capsys.readouterr().err
    assert code == 2
    what = {"file": "it is a file", "under a file": f"a parent is a file ('{blocker}')",
            "fifo": "it is a FIFO"}[kind]
    assert err.strip() == (f"towerflow train: error: The train directory '{train_dir}' cannot "
                           f"be made: {what}. Name a directory (it is created when missing), "
                           "or move that file away.")
    assert kind == "fifo" or blocker.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_the_model_the_serving_docs_build_exists_and_is_exported() -> None:
    assert towerflow.models.ClickNet.__name__ == "ClickNet"
    for doc in (ROOT / "README.md", ROOT / "docs" / "serving.md"):
        text = doc.read_text()
        built = set(re.findall(r"serving\.load\((?:\[[^\]]*\]|\"[^\"]*\"), (\w+)\(", text))
        assert built and built <= set(towerflow.models.__all__), (doc.name, built)


#: runs the command line with argv[1:] in a fresh interpreter; prints whether torch was imported
_NO_TORCH = """
import runpy, sys
sys.argv = ["towerflow", *sys.argv[1:]]
try:
    runpy.run_module("towerflow", run_name="__main__")
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["train", "--help"],
                                  ["train", "digits", "--max-step", "3"], ["train", "nosuch"],
                                  ["launch", "--help"], ["server", "--help"]])
def test_version_help_and_argument_errors_answer_without_importing_torch(argv) -> None:
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.stderr.splitlines()[-1] == "torch imported: False", proc.stderr[-2000:]
    if argv == ["--version"]:
        assert proc.stdout.strip() == f"towerflow {towerflow.__version__}"


#: a one-process step of a model with a sparse gradient, in a fresh interpreter (torch warns
#: once per process); prints the warnings it raised
_SPARSE_STEP = """
import warnings
import torch
from torch import nn
from towerflow.strategies import OptimizerConfig, SingleDevice
strategy = SingleDevice("cpu")
model = strategy.prepare(nn.Embedding(10, 4, sparse=True), OptimizerConfig("adagrad", lr=0.1))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy.run_step(lambda m, ids: m(ids).sum(), torch.tensor([1, 2, 2]))
print([str(w.message)[:60] for w in caught])
"""


def test_a_sparse_gradient_step_in_one_process_raises_no_torch_invariant_warning() -> None:
    proc = subprocess.run([sys.executable, "-c", _SPARSE_STEP], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
