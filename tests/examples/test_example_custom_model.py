"""examples/multi_gpu_custom_model.py runs with two CPU replicas and resumes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from towerflow.checkpoint import CheckpointManager, read_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multi_gpu_custom_model.py"


def test_docstring_has_the_commands_for_one_gpu_n_gpus_and_n_machines() -> None:
    doc = EXAMPLE.read_text()
    assert "torchrun --nproc-per-node 4" in doc and "--nnodes 2" in doc
    assert "--replicas 2 --cpu" in doc and "TF_CONFIG" in doc


@pytest.mark.slow
def test_example_trains_with_two_cpu_replicas(tmp_path, subprocess_env, python) -> None:
    cmd = [python, str(EXAMPLE), "--replicas", "2", "--cpu", "--train-dir", str(tmp_path),
           "--max-steps", "100"]
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^[\d-]+ [\d:.]+: step 100, loss = ", proc.stdout, re.MULTILINE)
    precision = float(re.search(r"test precision @ 1 = (\d\.\d+)", proc.stdout).group(1))
    assert precision > 0.8
    ckpt = read_checkpoint(CheckpointManager(tmp_path).latest())
    assert ckpt.step == 100 and ckpt.metadata["world_size"] == 2
    assert {"model", "optimizer", "ema"} <= set(ckpt.groups)


@pytest.mark.slow
def test_example_writes_under_the_current_directory_by_default(
        tmp_path, subprocess_env, python) -> None:
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    proc = subprocess.run([python, str(EXAMPLE), "--cpu", "--max-steps", "20"], cwd=work,
                          env={**subprocess_env, "TMPDIR": str(temp)}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert CheckpointManager(work / "runs" / "custom").latest().name == "ckpt-00000020"
    # PyTorch may keep its kernel cache there; the example itself writes nothing
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []
