"""benchmarks/hybrid_modes.py: its MovieLens files read as ml-100k; equal examples; the tables."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_file

HERE = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARK = HERE / "hybrid_modes.py"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark's module (it imports movielens_synthetic)
    load_file(HERE / "movielens_synthetic.py", "movielens_synthetic")
    return load_file(BENCHMARK, "hybrid_modes")


def test_its_movielens_files_read_as_ml100k_with_a_learnable_truth(bench, tmp_path):
    from towerflow.data.movielens import load_movielens

    truth = bench.write_movielens(tmp_path / "ml-100k", users=120, items=300, ratings=4000,
                                  seed=3)
    train, test = (load_movielens(tmp_path, split) for split in ("train", "test"))
    assert (len(train), len(test)) == (3200, 800)
    assert train.names == ("user", "item", "age", "gender", "occupation", "zip", "genres")
    assert 0.4 < float(train.labels.mean()) < 0.7  # about ml-100k's 55% rated 4+
    assert 0.75 < truth < 0.9  # the truth ranks the test split far better than chance
    again = bench.write_movielens(tmp_path / "again", users=120, items=300, ratings=4000, seed=3)
    assert again == truth
    assert (tmp_path / "again" / "u.data").read_bytes() == (tmp_path / "ml-100k" / "u.data").read_bytes()


def test_every_mode_trains_on_the_same_examples(bench, tmp_path):
    loads = bench.workloads(False, tmp_path)
    for workload in loads.values():
        per_step = {"hybrid": 2, "sync": 2, "async": 1, "one": 1, "async-rows": 1}
        for mode, batches in per_step.items():
            steps = bench.max_steps(mode, workload)
            assert steps * batches * workload.batch == workload.examples, (workload.name, mode)
    with pytest.raises(SystemExit, match="not a whole number"):
        bench.max_steps("sync", bench.Workload("odd", [], 256, 256 * 3))


def _run(bench, workload: str, mode: str, round_index: int, rate: float, auc: float):  # noqa: ANN001, ANN202
    return bench.Run(workload, mode, round_index, rates=[rate], auc=auc)


def test_the_table_takes_medians_and_each_rounds_own_ratio(bench):
    runs = [_run(bench, "movielens", "hybrid", 1, 100.0, 0.7660),
            _run(bench, "movielens", "async", 1, 50.0, 0.7600),
            _run(bench, "movielens", "sync", 1, 40.0, 0.7650),
            _run(bench, "movielens", "one", 1, 90.0, 0.7700),
            _run(bench, "movielens", "hybrid", 2, 60.0, 0.7680),  # a slower round for all
            _run(bench, "movielens", "async", 2, 40.0, 0.7620),
            _run(bench, "movielens", "sync", 2, 30.0, 0.7650),
            _run(bench, "movielens", "one", 2, 80.0, 0.7700),
            _run(bench, "movielens", "hybrid", 3, 80.0, 0.7670),
            _run(bench, "movielens", "async", 3, 100.0, 0.7610),
            _run(bench, "movielens", "sync", 3, 35.0, 0.7650),
            _run(bench, "movielens", "one", 3, 85.0, 0.7700)]
    rows = {row["mode"]: row for row in bench.summary(runs, "movielens",
                                                       ["hybrid", "async", "sync", "one"])}
    hybrid = rows["hybrid"]
    assert (hybrid["rate"], hybrid["rate_range"], hybrid["auc"]) == (80.0, (60.0, 100.0), 0.7670)
    assert hybrid["vs_async"] == 80.0 / 50.0
    assert hybrid["vs_async_rounds"] == 1.5  # median of 2.0, 1.5, 0.8
    assert math.isclose(hybrid["gap_sync"], 0.0020) and math.isclose(hybrid["gap_one"], -0.0030)
    lines = bench.targets(list(rows.values()))
    assert lines[0].endswith(": met") and lines[1].endswith(": missed")  # 0.0020 in, -0.0030 out
    assert "hybrid / async examples/s = 1.60" in lines[2] and lines[2].endswith("met")
    table = bench.table(list(rows.values()))
    assert table[2].startswith("| movielens | hybrid | 80 | 60-100 | 1.60 | 1.50 | 0.7670 |")
    assert "| - |" not in "\n".join(table)
    alone = bench.summary(runs[:1], "movielens", ["hybrid", "click-only-mode"])
    assert len(alone) == 1 and math.isnan(alone[0]["vs_async"])
    assert bench.table(alone)[2].count("| - ") == 4  # no async, sync nor one to compare with


def test_the_cpu_per_example_is_taken_between_the_first_and_last_step_line(bench):
    watch = bench.StepWatch("no-such-run", examples_per_step=512)
    watch.marks = [(10.0, 100, {"worker": 1.0, "ps": 0.5, "main": 0.1}),
                   (11.0, 150, {"worker": 1.2, "ps": 0.6, "main": 0.1}),
                   (12.0, 200, {"worker": 1.512, "ps": 0.756, "main": 0.1})]
    cpu, cores = watch.cpu()
    assert cpu["worker"] == pytest.approx(1e6 * 0.512 / (100 * 512))  # 10 µs per example
    assert cpu["ps"] == pytest.approx(1e6 * 0.256 / (100 * 512)) and cpu["main"] == 0.0
    assert cores == pytest.approx((0.512 + 0.256) / 2.0)
    run = bench.Run("click", "hybrid", 1, cpu_us={"worker": 8.0, "chief": 2.0, "ps": 5.0},
                    cores=1.5)
    assert bench.cpu_parts(run) == (10.0, 5.0, 0.0)
    assert "CPU per example 15.0 µs (workers 10.0, ps tasks 5.0" in bench.cpu_text(run)
    watch("2026-11-28 03:00:16.408788: step 25, loss = 0.64 (58578.2 examples/sec; 0.004 "
          "sec/batch)")
    assert watch.rates == [58578.2] and watch.marks[-1][1] == 25


@pytest.mark.slow
def test_the_quick_run_prints_a_row_per_workload_and_mode(bench, subprocess_env):
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick"], env=subprocess_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows, cpu = {}, {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) in (7, 10) and cells[0] in ("movielens", "click"):
            (rows if len(cells) == 10 else cpu)[cells[0], cells[1]] = cells
    assert sorted(rows) == [("click", "async"), ("click", "hybrid"),
                            ("movielens", "async"), ("movielens", "hybrid")], proc.stdout
    for cells in rows.values():
        rate, ratio, auc = (float(cells[i].replace(",", "")) for i in (2, 4, 6))
        assert rate > 0 and ratio > 0 and 0.5 < auc <= 1.0, cells
    assert sorted(cpu) == sorted(rows)
    for cells in cpu.values():  # total, workers, ps tasks, launcher: µs per example; cores
        figures = [float(cells[i]) for i in range(2, 7)]  # a quick run's window is short:
        assert all(math.isfinite(x) and x >= 0 for x in figures), cells  # a few clock ticks
    assert proc.stdout.count("towerflow eval: AUC = ") == 4  # its AUC agrees with --score's
    assert "click: hybrid / async examples/s = " in proc.stdout
    assert bench.processes_naming("hybrid-modes-") == []  # no task of a run outlives it
