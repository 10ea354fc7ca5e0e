"""benchmarks/ps_stack_costs.py: a row per server variant and the handler; differences per round."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_file

HERE = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARK = HERE / "ps_stack_costs.py"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark's module (it imports transport_compare's Child)
    for name in ("transport_peers", "transport_tls", "transport_compare"):  # its imports
        load_file(HERE / f"{name}.py", name)
    return load_file(BENCHMARK, "ps_stack_costs")


def test_a_request_is_a_click_steps_row_batch_to_shard_0(bench):
    from towerflow.ps.wire import tables_pb2 as tpb
    from towerflow.ps.wire.framing import split_parts, unpack

    requests = bench.Requests(1)
    first, second = requests.next(), requests.next()
    head, payload = unpack(second)
    batch = tpb.RowBatchRequest.FromString(head)
    pulled, pushed, grads = split_parts(payload, batch.parts, "RowBatch")
    item = batch.items[0]
    assert (item.pull.shard, item.push.seq, item.push.worker_id) == (0, 2, 1)
    assert len(pulled) == 8 * item.pull.num_ids and len(grads) == 4 * bench.DIM * len(pushed) // 8
    assert 1_000 < item.pull.num_ids < 1_500  # shard 0's half of a step's ~2,420 unique ids
    previous = tpb.RowBatchRequest.FromString(unpack(first)[0]).items[0]
    assert item.push.num_ids == previous.pull.num_ids  # the deferred push: the last step's ids
    head, payload = unpack(bench.prepared_reply())
    (rows,) = split_parts(payload, tpb.RowBatchReply.FromString(head).parts, "RowBatchReply")
    assert 1_000 * 4 * bench.DIM < len(rows) < 1_500 * 4 * bench.DIM


def test_the_attribution_is_the_median_of_each_rounds_own_difference(bench):
    def row(round_index: int, variant: str, cpu: float, handler: float | None = None) -> dict:
        return {"round": round_index, "variant": variant,
                "clients": 0 if variant.startswith("handler") else 2, "rate": 1.0,
                "server_us": cpu, "sys_us": 1.0, "ctx": 1.0, "handler_us": handler,
                "handler_ctx": 0.0, "client_us": 1.0, "p50": 1.0, "p99": 1.0}

    # round 1 runs on a slower machine: every figure doubled, the differences too
    results = [row(0, "grpc", 100), row(0, "stack", 130, 5), row(0, "full", 600, 400),
               row(0, "handler", 300, 300), row(0, "handler-gap", 350, 350),
               row(1, "grpc", 200), row(1, "stack", 260, 10), row(1, "full", 1200, 800),
               row(1, "handler", 600, 600), row(1, "handler-gap", 700, 700),
               row(2, "grpc", 100), row(2, "stack", 140, 5), row(2, "full", 640, 420),
               row(2, "handler", 300, 300), row(2, "handler-gap", 340, 340)]
    lines = {line["variant"]: line for line in bench.summary(results)}
    assert list(lines) == ["grpc", "stack", "full", "handler", "handler-gap"]
    assert lines["stack"]["minus_base"] == 40 and lines["stack"]["vs_base"] == 1.3
    assert lines["handler"]["vs_base"] is None and lines["handler"]["server_us"] == 300
    notes = "\n".join(bench.attribution(results)) + "\n"
    assert "stack - grpc: 40\n" in notes
    assert "left: full - stack - handler alone: 200\n" in notes  # 170, 340, 200
    assert "(its calls in full - alone): 120\n" in notes  # 100, 200, 120
    assert "(handler-gap - handler): 50\n" in notes
    assert "(stack - its stub's): 85\n" in notes  # (200 - 125), (400 - 250), (220 - 135)
    assert "auth" not in notes  # a variant not measured is not attributed


@pytest.mark.slow
def test_the_quickest_run_prints_finite_positive_figures_for_every_variant(bench, subprocess_env):
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--clients", "1",
                           "--seconds", "0.2", "--warmup", "3"],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 13 and cells[0] == "1":
            rows[cells[1]] = cells[2:]
    assert sorted(rows) == sorted((*bench.VARIANTS, *bench.HANDLERS)), proc.stdout
    for name, cells in rows.items():
        # req/s and the server's CPU per request for all; the clients' and latency for servers
        wanted = [0, 1] + ([] if name in bench.HANDLERS else [3, 6, 7, 8])
        figures = [float(cells[i].replace(",", "")) for i in wanted]
        assert all(math.isfinite(x) and x > 0 for x in figures), (name, cells)
        if name not in bench.HANDLERS:  # its system part: the OS counts it in 10 ms ticks,
            system = float(cells[2].replace(",", ""))  # so a short window may hold none
            assert math.isfinite(system) and 0 <= system <= figures[1], (name, cells)
    assert "left: full - stack - handler alone:" in proc.stdout

