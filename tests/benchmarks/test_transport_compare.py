"""benchmarks/transport_compare.py: a row per candidate; a click step's row bytes; skips said."""

from __future__ import annotations

import argparse
import json
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
def tls(peers):  # noqa: ANN201, ARG001 - the TLS set-up's module
    return load_file(HERE / "transport_tls.py", "transport_tls")


@pytest.fixture(scope="module")
def bench(peers, tls):  # noqa: ANN201, ARG001 - the benchmark's module (imports both)
    return load_file(BENCHMARK, "transport_compare")


@pytest.fixture(scope="module")
def zmq_peers(peers):  # noqa: ANN201, ARG001 - the ZeroMQ carriers' module (imports transport_peers)
    return load_file(HERE / "transport_zmq.py", "transport_zmq")


def installed(bench, *names: str) -> list[str]:  # noqa: ANN001
    """The candidates among ``names`` whose package (not a towerflow dependency) is installed
    (``zmq-curve``: and whose libzmq has CURVE)."""
    return bench.available(list(names))[0]


def table(stdout: str) -> dict[tuple[str, int, str], list[float]]:
    """The printed table: ``{(kind, clients, candidate): its 6 figures and 4 ratios}``."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 13 and cells[0] in ("small", "row", "dense"):
            rows[cells[0], int(cells[1]), cells[2]] = [float(cell.replace(",", ""))
                                                       for cell in cells[3:]]
    return rows


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


def test_zmq_curve_is_skipped_in_that_line_without_curve_in_libzmq(bench):
    found = {"zmq": "a spec"}.get  # pyzmq installed, uvloop not
    kept, line = bench.available(["tcp", "zmq", "zmq-curve", "zmq-hmac"], find=found,
                                 curve=lambda: False)
    assert kept == ["tcp", "zmq", "zmq-hmac"]
    assert line == "skipped: zmq-curve (pyzmq's libzmq has no CURVE)"
    kept, line = bench.available(["zmq-curve", "asyncio-uvloop"], find=found,
                                 curve=lambda: False)
    assert kept == [] and line == ("skipped: asyncio-uvloop (uvloop not installed), zmq-curve "
                                   "(pyzmq's libzmq has no CURVE); pip install -e .[bench]")
    assert bench.available(["zmq-curve"], find=found, curve=lambda: True) == (["zmq-curve"], "")


def test_the_tls_candidates_are_skipped_in_that_line_without_openssl(bench):
    names = ["tcp", "tcp-tls", "grpc-stream-tls", "asyncio-uvloop-tls"]
    kept, line = bench.available(names, find=lambda module: None, openssl=lambda: False)
    assert kept == ["tcp"]
    assert line == ("skipped: asyncio-uvloop-tls (uvloop not installed), tcp-tls (no openssl "
                    "command for its certificates), grpc-stream-tls (no openssl command for "
                    "its certificates); pip install -e .[bench]")
    kept, line = bench.available(names[:3], openssl=lambda: False)
    assert kept == ["tcp"] and line.endswith("its certificates)")  # no pip line
    assert bench.available(names[:3], openssl=lambda: True) == (names[:3], "")


def test_the_tls_contexts_ask_tls_1_3_and_the_client_checks_the_ca_and_host(tls, tmp_path):
    import ssl

    if not tls.has_openssl():
        pytest.skip("the openssl command is not installed")
    certs = tls.make_certs(tmp_path)
    server, client = tls.server_context(certs), tls.client_context(certs)
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    assert [ca["subject"] for ca in client.get_ca_certs()] == [((("commonName", "bench-ca"),),)]
    san = ssl._ssl._test_decode_cert(str(certs / "server.pem"))["subjectAltName"]
    assert ("IP Address", "127.0.0.1") in san and ("DNS", "localhost") in san


def test_the_curve_and_hmac_keys_are_the_cluster_secrets(zmq_peers):
    pytest.importorskip("zmq")
    server, client = (zmq_peers.curve_keys(b"bench-secret", role)
                      for role in ("server", "client"))
    assert server == zmq_peers.curve_keys(b"bench-secret", "server")  # deterministic
    assert len({*server, *client, *zmq_peers.curve_keys(b"other", "client")}) == 6
    assert all(len(key) == 40 for key in (*server, *client))  # z85 of 32 bytes
    request, reply = zmq_peers.mac_keys(b"bench-secret")
    assert request != reply and zmq_peers.mac_keys(b"other")[0] != request


def test_a_sealed_message_opens_once_and_a_changed_byte_or_a_replay_does_not(zmq_peers):
    class Frame:  # what recv_multipart(copy=False) gives
        def __init__(self, data: bytes) -> None:
            self.bytes, self.buffer = data, memoryview(data)

    for body in (False, True):
        sealer, opener = zmq_peers.Sealer(b"k" * 32, body), zmq_peers.Opener(b"k" * 32, body)
        first, second = sealer.seal(2, 1, b"payload"), sealer.seal(2, 0, b"payload")
        forged = [first[0], first[1], b"pay1oad"]
        # a changed payload fails only where the MAC covers it
        assert (opener.open(*map(Frame, forged[:2]), [Frame(forged[2])]) is None) == body
        opener = zmq_peers.Opener(b"k" * 32, body)
        assert opener.open(Frame(first[0]), Frame(first[1]), [Frame(first[2])]) == (2, 1)
        assert opener.open(Frame(first[0]), Frame(first[1]), [Frame(first[2])]) is None
        assert opener.open(Frame(second[0]), Frame(second[1]), [Frame(second[2])]) == (2, 0)
        other = zmq_peers.Opener(b"x" * 32, body)
        assert other.open(Frame(first[0]), Frame(first[1]), [Frame(first[2])]) is None


@pytest.mark.slow
def test_a_curve_client_with_another_key_is_refused(bench, zmq_peers, subprocess_env):
    zmq = pytest.importorskip("zmq")
    if not zmq.has("curve"):
        pytest.skip("pyzmq's libzmq has no CURVE")
    args = argparse.Namespace(small_bytes=1024, dense_chunks=2, warmup_chunks=1)
    server = bench.Child(args, "server", "zmq-curve")
    try:
        port = json.loads(server.expect(60))["port"]
        keys = zmq_peers.curve_keys(zmq_peers.SECRET, "client")
        outcome, reply = zmq_peers.handshake(port, keys, b"x", timeout=30)
        assert outcome == "succeeded" and len(reply) == 1024  # the small reply
        # no reply in 2 s: the request waits behind a handshake that fails on every retry
        for wrong in (zmq.curve_keypair(), zmq_peers.curve_keys(b"another-secret", "client")):
            assert zmq_peers.handshake(port, wrong, b"x", timeout=2) == ("failed-auth", None)
        # the server still answers the right key after refusing others
        outcome, reply = zmq_peers.handshake(port, keys, b"x", timeout=30)
        assert outcome == "succeeded" and len(reply) == 1024
    finally:
        server.stop()
    assert server.proc.returncode == 0  # it ended by itself once its stdin closed


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
def test_the_smallest_run_prints_a_row_of_finite_positive_figures_per_candidate(
        bench, subprocess_env):
    candidates = installed(bench, "tcp", "grpc-stream", "zmq", "zmq-hmac", "zmq-hmac-body",
                           "asyncio-uvloop")
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--clients", "1",
                           "--kinds", "small", "--candidates", *candidates],
                          env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {name: figures for (_, _, name), figures in table(proc.stdout).items()}
    assert sorted(rows) == sorted(candidates), proc.stdout
    for name, figures in rows.items():
        assert len(figures) == 10, (name, figures)  # 6 figures, 4 ratios
        # req/s above zero; a rounded figure of a loaded machine may print as 0.000
        assert figures[0] > 0 and all(math.isfinite(x) and x >= 0 for x in figures), \
            (name, figures)
    assert rows["grpc-stream"][6:8] == [1.0, 1.0] and rows["tcp"][8:] == [1.0, 1.0]


def _quick_run(candidates: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``--quick`` over ``candidates``: a row of finite figures per kind, client count and
    candidate, req/s above zero (a rounded figure of a loaded machine may print as 0.000)."""
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--candidates",
                           *candidates], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert sorted(rows) == sorted((kind, clients, name) for kind in ("small", "row", "dense")
                                  for clients in (1, 2) for name in candidates), proc.stdout
    for key, figures in rows.items():
        assert figures[0] > 0 and all(math.isfinite(x) and x >= 0 for x in figures), \
            (key, figures)
    return proc


@pytest.mark.slow
def test_the_quick_run_with_zmq_curve_prints_finite_positive_figures(bench, subprocess_env):
    if installed(bench, "zmq-curve") != ["zmq-curve"]:
        pytest.skip(bench.available(["zmq-curve"])[1])
    candidates = ["tcp", "grpc-stream", "zmq-curve"]
    _quick_run(candidates, subprocess_env)


@pytest.mark.slow
def test_the_quick_run_with_the_tls_candidates_prints_finite_positive_figures(
        bench, subprocess_env):
    tls = ["tcp-tls", "grpc-stream-tls", "asyncio-uvloop-tls"]
    candidates = installed(bench, "tcp", "grpc-stream", *tls)
    if not set(tls) <= set(candidates):
        pytest.skip(bench.available(tls)[1])
    proc = _quick_run(candidates, subprocess_env)
    # the ssl clients say the TLS version and the cipher negotiated
    for name in ("tcp-tls", "asyncio-uvloop-tls"):
        assert f"\n{name}: TLSv1.3 TLS_" in proc.stdout, proc.stdout
