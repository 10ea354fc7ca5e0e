"""benchmarks/transport_compare.py: a row per candidate; a click step's row bytes; skips said."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_file

HERE = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARK = HERE / "transport_compare.py"


@pytest.fixture(scope="module")
def peers():  # noqa: ANN201 - the benchmark's process module
    return load_file(HERE / "transport_peers.py", "transport_peers")


@pytest.fixture(scope="module")
def bench(peers):  # noqa: ANN201, ARG001 - the benchmark's module (it imports transport_peers)
    return load_file(BENCHMARK, "transport_compare")


def installed(*names: str) -> list[str]:
    """The candidates among ``names`` whose package (not a towerflow dependency) is installed."""
    needs = {"zmq": "zmq", "asyncio-uvloop": "uvloop"}
    return [name for name in names if name not in needs or importlib.util.find_spec(needs[name])]


def test_the_row_kind_is_a_framed_row_batch_of_a_click_step(peers):
    from towerflow.ps.wire import tables_pb2 as tpb
    from towerflow.ps.wire.framing import split_parts, unpack

    request, reply = peers.row_messages()
    head, payload = unpack(request)
    batch = tpb.RowBatchRequest.FromString(head)
    pulled, pushed, grads = split_parts(payload, batch.parts, "RowBatch")
    item = batch.items[0]
    assert len(pulled) == 8 * item.pull.num_ids and len(pushed) == 8 * item.push.num_ids
    assert len(grads) == 4 * peers.DIM * item.push.num_ids
    assert 2_000 < item.pull.num_ids < 3_000  # the unique ids of a 512 x 16 Zipf(1.2) batch
    head, payload = unpack(reply)
    answer = tpb.RowBatchReply.FromString(head)
    (rows,) = split_parts(payload, answer.parts, "RowBatchReply")
    assert len(rows) == 4 * peers.DIM * answer.items[0].pull.num_ids
    assert answer.items[0].pull.num_ids == item.pull.num_ids
    assert 620_000 < len(request) + len(reply) < 700_000  # a click worker's step: ~659 KB


def test_a_candidate_whose_package_is_missing_is_named_in_one_line(bench):
    kept, line = bench.available(["tcp", "zmq", "asyncio-uvloop", "grpc-stream"],
                                 find=lambda module: None)
    assert kept == ["tcp", "grpc-stream"]
    assert line == ("skipped: zmq (pyzmq not installed), asyncio-uvloop (uvloop not installed)"
                    "; pip install -e .[bench]")
    assert bench.available(["tcp"], find=lambda module: None) == (["tcp"], "")


def test_the_ratios_are_the_medians_of_each_rounds_own_ratio(bench):
    def run(round_index: int, name: str, gbps: float, cpu: float) -> dict:
        return {"round": round_index, "kind": "row", "clients": 2, "candidate": name,
                "rate": gbps, "gbps": gbps, "server_us": cpu, "client_us": 1.0,
                "p50": 1.0, "p99": 2.0}

    # the machine slowed down in round 1: every candidate slower, the ratios the same
    lines = bench.summary([run(0, "tcp", 8.0, 40.0), run(0, "grpc-stream", 2.0, 200.0),
                           run(0, "zmq", 4.0, 80.0), run(1, "zmq", 1.0, 320.0),
                           run(1, "grpc-stream", 0.5, 800.0), run(1, "tcp", 2.0, 160.0)])
    assert [line["candidate"] for line in lines] == ["tcp", "grpc-stream", "zmq"]
    zmq = lines[2]
    assert zmq["gbps_vs_grpc-stream"] == 2.0 and zmq["cpu_vs_grpc-stream"] == 0.4
    assert zmq["gbps_vs_tcp"] == 0.5 and zmq["cpu_vs_tcp"] == 2.0
    assert zmq["gbps"] == 2.5


@pytest.mark.slow
def test_the_smallest_run_prints_a_row_of_finite_positive_figures_per_candidate(subprocess_env):
    candidates = installed("tcp", "grpc-stream", "zmq", "asyncio-uvloop")
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--clients", "1",
                           "--kinds", "small", "--candidates", *candidates],
                          env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[:2] == ["small", "1"]:
            rows[cells[2]] = [float(cell.replace(",", "")) for cell in cells[3:]]
    assert sorted(rows) == sorted(candidates), proc.stdout
    for name, figures in rows.items():
        assert len(figures) == 10, (name, figures)  # 6 figures, 4 ratios
        assert all(math.isfinite(x) and x > 0 for x in figures), (name, figures)
    assert rows["grpc-stream"][6:8] == [1.0, 1.0] and rows["tcp"][8:] == [1.0, 1.0]
