"""``towerflow train click`` / ``towerflow eval``: the click model in one process and on ps tasks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from towerflow.checkpoint import latest_checkpoint, read_checkpoint
from towerflow.cli import main

AUC = re.compile(r"^AUC = (\d\.\d{4}) \(the truth's (\d\.\d{4}) on the same examples, "
                 r"gap (-?\d\.\d{4})\)$", re.MULTILINE)
SMALL = ["--table-rows", "2000", "--ids-per-example", "8", "--embedding-dim", "8",
         "--summary-every", "0", "--no-progress"]
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sparse_worker_memory.py"


def _auc(out: str) -> tuple[float, float, float]:
    match = AUC.search(out)
    assert match is not None, out
    return tuple(float(x) for x in match.groups())


@pytest.mark.slow
def test_click_trains_in_one_process_and_eval_prints_its_auc_against_the_truth(
        tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "click", *SMALL, "--max-steps", "200", "--log-every", "100",
                 "--train-dir", str(run)]) == 0
    settings = yaml.safe_load((run / "run.yaml").read_text())
    assert {k: settings[k] for k in ("model", "table_rows", "embedding_dim", "ids_per_example",
                                     "optimizer", "initial_accumulator_value", "batch_size",
                                     "ema_decay")} == {
        "model": "click", "table_rows": 2000, "embedding_dim": 8, "ids_per_example": 8,
        "optimizer": "adagrad", "initial_accumulator_value": 1e-4, "batch_size": 512,
        "ema_decay": 0.0}
    ckpt = read_checkpoint(latest_checkpoint(run))
    assert ckpt.step == 200 and ckpt.groups["model"]["table.weight"].shape == (2000, 8)
    assert ckpt.metadata["data"] == {"batches": 200}  # the stream's position, for a resume
    capsys.readouterr()
    assert main(["eval", "--train-dir", str(run), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "step 200: parameters of" in out and "on 50000 test examples" in out
    model_auc, truth_auc, gap = _auc(out)
    assert truth_auc > 0.75 and gap == pytest.approx(truth_auc - model_auc, abs=2e-4)
    assert gap < 0.03, out


def test_a_resumed_click_run_keeps_its_recorded_settings_and_eval_scores_it(
        tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "click", *SMALL, "--max-steps", "5", "--batch-size", "64",
                 "--train-dir", str(run)]) == 0
    assert main(["train", "--train-dir", str(run), "--max-steps", "8"]) == 0
    ckpt = read_checkpoint(latest_checkpoint(run))
    assert ckpt.step == 8 and ckpt.metadata["batch_size"] == 64
    assert ckpt.metadata["data"] == {"batches": 8}  # the stream went on where it stopped
    assert main(["train", "--train-dir", str(run), "--max-steps", "9", "--table-rows", "3000"]) == 2
    assert re.search(r"table.rows", capsys.readouterr().err)
    assert main(["eval", "click", "--train-dir", str(run), "--device", "cpu"]) == 0
    model_auc, truth_auc, gap = _auc(capsys.readouterr().out)
    assert 0.0 <= model_auc <= 1.0 and gap == pytest.approx(truth_auc - model_auc, abs=2e-4)


@pytest.mark.slow
def test_click_on_one_ps_and_two_workers_shards_its_table_and_reaches_the_truths_auc(
        tmp_path, subprocess_env, capsys) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "towerflow", "train", "click", "--ps", "1", "--workers", "2",
               *SMALL, "--max-steps", "600", "--log-every", "100",
               "--train-dir", str(run)]
    proc = subprocess.run(command, env=subprocess_env, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for worker in (0, 1):  # each swapped its (never allocated) sparse=True table by default
        assert f"[worker:{worker}] 'table' 2,000 x 8 (64 kB) -> rows on 1 ps task, row-wise " \
            "adagrad" in out, out[-5000:]
    assert re.search(r"\[ps:0\] table 'table' shard 0: 2000 rows x 8 \(128000 bytes with slots\)",
                     out), out[-5000:]
    ckpt = read_checkpoint(latest_checkpoint(run))
    assert ckpt.step == 600  # two asynchronous workers, and not one push past the last step
    assert "table.weight" not in ckpt.groups["model"]  # the rows are the ps's, saved in parts
    assert sum(info["rows"] for info in ckpt.chunked["ps_tables"].infos) == 2000
    capsys.readouterr()
    assert main(["eval", "--train-dir", str(run)]) == 0  # in this process: no torch start-up
    out = capsys.readouterr().out
    _, truth_auc, gap = _auc(out)
    assert truth_auc > 0.75 and gap <= 0.02, out


@pytest.mark.slow
def test_a_worker_under_a_memory_cap_smaller_than_its_table_trains_through_the_ps(
        subprocess_env) -> None:
    # a worker's resident memory (RSS) capped at 208 MiB over what a process that imports
    # this build of torch and towerflow holds (about 464 MiB with a CPU build, more with a
    # CUDA build's libraries), and a table 24 MiB larger than the cap; the benchmark also
    # runs the same worker with the table in its own memory and fails unless the cap stops
    # it (tests/benchmarks/test_memory_cap.py: the cap itself, under large mappings)
    from file_modules import load_file

    baseline = load_file(BENCHMARK, "sparse_worker_memory").run_under_rss_cap(
        [sys.executable, "-c", "import torch, towerflow.strategies.parameter_server"],
        1 << 40, timeout=120, env=subprocess_env)["peak_rss"]
    cap_mib = baseline // 2**20 + 208
    rows = (cap_mib + 24) * 2**20 // (64 * 4)
    command = [sys.executable, str(BENCHMARK), "--only", "cap", "--capped-rows", str(rows),
               "--dim", "64", "--cap", f"{cap_mib}MiB", "--steps", "5"]
    proc = subprocess.run(command, env=subprocess_env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    line = re.search(r"([\d,]+) rows \((\d+) MiB table\), worker under an RSS cap of (\d+) MiB "
                     r"\(cap / table = 0\.\d+\): trained 5 steps \(.*\), peak RSS ([\d,]+) MiB",
                     proc.stdout)
    assert line is not None, proc.stdout
    table, cap, peak = (int(x.replace(",", "")) for x in line.groups()[1:])
    assert peak < cap == cap_mib < table, proc.stdout
    assert "control: the same worker with the table in its own memory under the same cap was " \
           "stopped: its resident memory (RSS)" in proc.stdout, proc.stdout
    assert f"went over the cap of {cap_mib} MiB" in proc.stdout, proc.stdout
