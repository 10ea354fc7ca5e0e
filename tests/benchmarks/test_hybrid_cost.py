"""benchmarks/hybrid_cost.py: its grid, ring bytes and fit; a quick run's table."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_file

HERE = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARK = HERE / "hybrid_cost.py"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark's module
    return load_file(BENCHMARK, "hybrid_cost")


def test_the_grid_crosses_topologies_at_the_smallest_dense_size_then_grows_it(bench):
    assert bench.grid([2, 3], [1, 2], [0, 100, 10]) == [
        (2, 1, 0), (2, 2, 0), (3, 1, 0), (3, 2, 0), (2, 2, 10), (2, 2, 100)]
    two = bench.Setting("hybrid", 2, 1, 0)
    assert two.ring_bytes == 4 * bench.MODEL_DENSE and two.batches_per_step == 2
    assert bench.Setting("hybrid", 4, 1, 878).ring_bytes == 1.5 * 4 * 2000
    assert bench.Setting("async", 4, 1, 0).batches_per_step == 1


def test_the_fit_recovers_the_costs_it_was_built_from(bench):
    def result(workers: int, ps: int, extra: int):  # noqa: ANN202
        setting = bench.Setting("hybrid", workers, ps, extra)
        w = 3.0 + 0.5 * ps + 2.0 * setting.ring_bytes / 1e6  # ms per worker step
        q = 1.5 * ps + 1.0
        per_us = 1e3 / bench.BATCH  # µs per example of 1 ms per step
        return bench.Result(setting, 1, 1.0, {"worker": w * per_us, "ps": q * per_us}, 1.0)

    runs = [result(w, p, e) for w, p, e in bench.grid([2, 3, 4], [1, 2], [0, 262_144])]
    model = bench.fit(runs)
    assert model == pytest.approx({"w0": 3.0, "w1": 0.5, "r": 2.0, "a": 1.5, "c": 1.0})
    lines = bench.table(bench.summary(runs), model)
    row = next(line for line in lines if line.startswith("| 2 | 2 | 1,122 | hybrid"))
    w = 3.0 + 0.5 * 2 + 2.0 * 4 * 1122 / 1e6
    assert f"| {1e3 * (w + 4.0) / 512:.1f} |" in row  # the model's own µs per example
    assert bench.fit(runs[:2]) == {}  # too few settings to fit


def test_the_model_factory_pads_the_dense_layers(bench, monkeypatch):
    monkeypatch.setenv(bench.PAD_ENV, "1000")
    monkeypatch.setenv("HYBRID_COST_ROWS", "50")
    model = bench.build()
    dense = sum(p.numel() for n, p in model.named_parameters() if "table" not in n)
    assert dense == bench.MODEL_DENSE + 1000
    ids, clicks = next(iter(bench.batches("train", 8, rank=1, seed=0)))
    assert tuple(ids.shape) == (8, bench.BAG) and clicks.dtype.is_floating_point


@pytest.mark.slow
def test_the_quick_run_prints_a_row_per_setting(bench, subprocess_env):
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick"], env=subprocess_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| 2 | 1 |")]
    assert [(r[2], r[3]) for r in rows] == [("1,122", "hybrid"), ("1,122", "async"),
                                           ("5,218", "hybrid"), ("5,218", "async")]
    for cells in rows:
        rate, worker_ms, ps_ms = (float(cells[i].replace(",", "")) for i in (4, 5, 6))
        assert rate > 0 and math.isfinite(worker_ms) and math.isfinite(ps_ms), cells
