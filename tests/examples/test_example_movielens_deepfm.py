"""examples/movielens_deepfm.py: DeepFM the plain PyTorch way learns a planted taste in one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from file_modules import load_file
from recsys_files import write_ml100k

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "movielens_deepfm.py"


@pytest.mark.slow
def test_the_example_trains_in_one_process_and_prints_auc_and_logloss(
        tmp_path, capsys, monkeypatch) -> None:
    for name in ("TF_CONFIG", "SLURM_JOB_ID", "SLURM_PROCID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    write_ml100k(tmp_path / "data" / "ml-100k")
    example = load_file(EXAMPLE, "movielens_deepfm")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert example.main(["--data-dir", str(tmp_path / "data"), "--train-dir",
                             str(tmp_path / "run"), "--steps", "100", "--batch-size", "64"]) == 0
    finally:
        torch.set_num_threads(threads)
    found = re.search(r"step 100: AUC = ([\d.]+), logloss = ([\d.]+)", capsys.readouterr().out)
    assert found is not None
    assert float(found.group(1)) > 0.75 and 0 < float(found.group(2)) < 0.69
