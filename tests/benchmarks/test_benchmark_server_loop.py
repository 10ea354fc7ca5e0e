"""benchmarks/grpc_server_loop.py: every server kind does the same work; ratios within rounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_file

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "grpc_server_loop.py"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark's module
    return load_file(BENCHMARK, "grpc_server_loop")


def test_every_server_kind_answers_rows_and_dense_as_the_local_reference(subprocess_env):
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--check"], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for kind in ("thread", "aio-loop", "aio-executor"):
        assert f"check: {kind} server answers rows and dense as the reference" in proc.stdout


def test_a_row_request_decodes_to_views_of_what_was_encoded(bench):
    import numpy as np

    ids, pushed = np.array([5, 1, 9], np.int64), np.array([2, 3], np.int64)
    grads = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = bench.decode_rows(bench.encode_rows(ids, pushed, grads))
    assert [a.tolist() for a in got] == [ids.tolist(), pushed.tolist(), grads.tolist()]


def test_the_ratio_is_the_median_of_each_rounds_own_ratio(bench):
    def run(round_index: int, kind: str, rate: float, cpu: float) -> dict:
        return {"round": round_index, "traffic": "rows", "clients": 2, "kind": kind,
                "rate": rate, "cpu_per_request": cpu}

    # the machine slowed down in round 1: both kinds slower, the ratio the same
    lines = bench.summary([run(0, "thread", 100.0, 1.0), run(0, "aio-loop", 150.0, 0.5),
                           run(1, "aio-loop", 30.0, 2.0), run(1, "thread", 20.0, 4.0),
                           run(2, "thread", 90.0, 1.0), run(2, "aio-loop", 90.0, 1.0)])
    aio = next(line for line in lines if line["kind"] == "aio-loop")
    assert aio["ratios"] == [1.5, 1.5, 1.0]
    assert aio["ratio"] == 1.5 and aio["cpu_ratio"] == 0.5
    assert aio["rate"] == 90.0
