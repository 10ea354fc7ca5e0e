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


TRUTH = {"w0": 3.0, "w1": 0.5, "g": 0.8, "r": 1.0, "a": 0.9, "c": 0.3, "s": 0.6}


def _result(bench, mode: str, workers: int, ps: int, extra: int, round_index: int = 1):  # noqa: ANN001, ANN202
    setting = bench.Setting(mode, workers, ps, extra)
    moved = bench.moved_mb(setting)
    w = TRUTH["w0"] + TRUTH["w1"] * ps + TRUTH["g"] * (workers - 1) + TRUTH["r"] * moved
    q = TRUTH["a"] * ps + TRUTH["c"] + TRUTH["s"] * moved  # ms per worker step
    per_us = 1e3 / bench.BATCH  # µs per example of 1 ms per step
    return bench.Result(setting, round_index, 1e5, {"worker": w * per_us, "ps": q * per_us},
                        1.5)


def test_the_fit_recovers_the_costs_it_was_built_from(bench):
    settings = bench.grid([2, 3, 4], [1, 2], [0, 262_144])
    runs = [_result(bench, mode, w, p, e) for w, p, e in settings for mode in ("hybrid", "async")]
    for mode in ("hybrid", "async"):
        assert bench.fit(runs, mode) == pytest.approx(TRUTH)
    assert bench.moved_mb(bench.Setting("async", 2, 1, 0)) == 8 * bench.MODEL_DENSE / 1e6
    models = {mode: bench.fit(runs, mode) for mode in ("hybrid", "async")}
    lines = bench.table(bench.summary(runs), models)
    row = next(line for line in lines if line.startswith("| 2 | 2 | 1,122 | hybrid"))
    cost = bench.predicted_ms(TRUTH, bench.Setting("hybrid", 2, 2, 0))
    assert f"| {1e3 * cost / 512:.1f} | {1.5 * 512 / cost * 1e3:,.0f} |" in row
    assert bench.fit(runs[:4], "hybrid") == {}  # too few runs to separate the terms
    assert "(W - 1) + 1.00 M ms; all ps tasks q = 0.90 P + 0.30 + 0.60 M ms" in \
        bench.fit_text(TRUTH, "hybrid")


def test_an_earlier_runs_lines_are_read_back(bench):
    line = ("round 2: hybrid 3 workers 1 ps, 263,266 dense values: 90,948 examples/s; worker CPU "
            "6.05 ms, ps 2.12 ms per worker step; 1.42 cores; load average 4.5\n")
    (result,) = bench.from_log("noise\n" + line)
    assert result.setting == bench.Setting("hybrid", 3, 1, 262_144)
    assert (result.round, result.rate, result.cores) == (2, 90948.0, 1.42)
    assert result.per_step_ms("worker") == pytest.approx(6.05)
    assert result.per_step_ms("ps") == pytest.approx(2.12)


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
