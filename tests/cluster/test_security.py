"""End-to-end security: a real ps refuses unauthenticated and bad input, and src has no pickle."""

from __future__ import annotations

import ast
import socket
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from towerflow.cluster.auth import AUTH_METADATA_KEY, ClientAuth, make_token
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing import LocalCluster, leftover_processes
from towerflow.testing.probes import PROBE_SHAPES, probe_bad_inputs

SRC = Path(__file__).resolve().parents[2] / "src" / "towerflow"
PS_METHODS = ("Init", "Status", "Push", "PushPull", "PushPullSmall", "Pull", "Done", "Ledger")




def _raw_call(address: str, method: str, payload: bytes, metadata=()) -> grpc.StatusCode:
    """Call through a bare gRPC channel (no towerflow interceptor); return the status code."""
    with grpc.insecure_channel(address) as channel:
        try:
            if method.endswith(("/Push", "/Init")):
                channel.stream_unary(method)(iter([payload]), timeout=10, metadata=metadata)
            elif method.endswith("/PushPull"):
                list(channel.stream_stream(method)(iter([payload]), timeout=10,
                                                   metadata=metadata))
            elif method.endswith("/Pull"):
                list(channel.unary_stream(method)(payload, timeout=10, metadata=metadata))
            else:
                channel.unary_unary(method)(payload, timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.slow
def test_every_bad_input_is_refused_by_a_real_ps_and_changes_nothing(ps_process, tmp_path):
    spec, lc, ps = ps_process
    results = probe_bad_inputs(spec, lc.credentials, workdir=tmp_path)
    assert [r.name for r in results if not r.refused] == [], results
    details = {r.name: r.detail for r in results}
    assert len(results) >= 13
    assert "has shape [4, 16] but the parameter has shape [16, 4]" in details["wrong shape"]
    assert "has dtype float64" in details["wrong dtype"]
    assert "contains NaN or inf in variable 'w'" in details["NaN"]
    assert "contains NaN or inf" in details["inf"]
    assert "UNAUTHENTICATED" in details["unauthenticated call"]
    assert "wrong credentials" in details["wrong secret"]
    assert "RESOURCE_EXHAUSTED" in details["oversized message"]
    assert "Malformed PushRequest" in details["malformed push header"]
    assert "fails its checksum" in details["corrupt checkpoint"]
    # the ps still serves honest workers after all of that
    honest = PSClient(spec, plan_placement(PROBE_SHAPES, 1), worker_id=0,
                      credentials=lc.credentials, timeout=10.0)
    try:
        result = honest.push([np.ones(68, np.float32)], lr=0.5)
        assert result.applied and result.global_step == 1
        stats = honest.stats()[0]
        assert stats["applied"] == 1 and stats["refused"] >= 5
    finally:
        honest.close(done=False)
    ps.wait_for_line(r"refused call to /towerflow\.ps\.PS/\w+: no credentials", timeout=10)


@pytest.mark.slow
def test_calls_without_or_with_forged_credentials_reach_no_ps_method(ps_process):
    spec, lc, _ = ps_process
    address = spec.task_address("ps", 0)
    secret = lc.credentials.secret
    honest = PSClient(spec, plan_placement({"w": (8,)}, 1), worker_id=0,
                      credentials=lc.credentials, timeout=10.0)
    try:
        start = np.arange(8, dtype=np.float32)
        honest.initialize([start], optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig())
        garbage = b"\x08\x01"
        with grpc.insecure_channel(address) as raw:
            server = ClientAuth(secret, raw, address).identity(10.0)

        def token(key: bytes, method: str, **kwargs) -> list[tuple[str, str]]:
            return [(AUTH_METADATA_KEY, make_token(key, method, server, garbage, **kwargs))]

        for name in PS_METHODS:
            method = f"/towerflow.ps.PS/{name}"
            assert _raw_call(address, method, garbage) == grpc.StatusCode.UNAUTHENTICATED, name
            wrong = token(b"guessed", method)
            assert _raw_call(address, method, garbage, wrong) == grpc.StatusCode.UNAUTHENTICATED
            # a genuine token, but minted for another method
            other = token(secret, "/towerflow.cluster.Control/Ping")
            assert _raw_call(address, method, garbage, other) == grpc.StatusCode.UNAUTHENTICATED
            # a genuine token for this method, but from long ago
            old = token(secret, method, now=time.time() - 3600)
            assert _raw_call(address, method, garbage, old) == grpc.StatusCode.UNAUTHENTICATED
        # a sniffed genuine token works once, never twice
        status = "/towerflow.ps.PS/Status"
        sniffed = [(AUTH_METADATA_KEY, make_token(secret, status, server, b""))]
        assert _raw_call(address, status, b"", sniffed) == grpc.StatusCode.OK
        assert _raw_call(address, status, b"", sniffed) == grpc.StatusCode.UNAUTHENTICATED
        after = np.empty(8, np.float32)
        assert honest.pull([after]) == 0
        np.testing.assert_array_equal(after, start)
        assert honest.stats()[0]["pushes"] == 0
    finally:
        honest.close(done=False)


def _public_address() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for UDP connect
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") else host


@pytest.mark.slow
def test_a_real_server_refuses_a_non_loopback_address_without_a_secret(subprocess_env, free_ports):
    host = _public_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = free_ports(1)[0]
    from towerflow.cluster import ClusterSpec

    spec = ClusterSpec({"ps": [f"{host}:{port}"]})
    command = [sys.executable, "-m", "towerflow", "server"]
    with LocalCluster(spec, command, env=subprocess_env, secret=False) as lc:
        refused = lc.start("ps", 0)
        assert refused.wait(timeout=60) != 0
        assert refused.find(r"refusing to serve /job:ps/replica:0/task:0 on non-loopback address "
                            r"\S+ without authentication")
        with socket.socket() as s:
            assert s.connect_ex((host, port)) != 0  # nothing listens there
        insecure = lc.start("ps", 0, extra_args=["--insecure"])
        insecure.wait_for_line(r"WITHOUT authentication \(insecure\)", timeout=60)
        insecure.wait_for_line(r"ps task 0 serving at", timeout=60)
    with LocalCluster(spec, command, env=subprocess_env, secret=True) as lc:
        # a secret authenticates the calls, but the traffic would cross the network readable
        plaintext = lc.start("ps", 0)
        assert plaintext.wait(timeout=60) != 0
        assert plaintext.find(r"non-loopback address \S+ in plaintext \(without TLS\)")
        lc.start("ps", 0, extra_args=["--insecure"]).wait_for_line(r"ps task 0 serving at",
                                                                   timeout=60)
        assert "in plaintext (insecure): calls are authenticated" in lc.task("ps", 0).output()
        assert "WITHOUT authentication" not in lc.task("ps", 0).output()
    assert leftover_processes() == []


# -- the source tree never unpickles nor runs code it is sent ---------------------------------
_FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                      "joblib"}
_FORBIDDEN_CALLS = {"torch.load", "torch.save", "eval", "exec", "compile", "__import__",
                    "yaml.load", "yaml.unsafe_load", "numpy.load", "np.load", "pickle.loads"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_constructs(source: str, filename: str = "<src>") -> list[str]:
    """Where ``source`` imports a pickling module, calls an unsafe loader or runs code."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in _FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] in _FORBIDDEN_MODULES:
            found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in _FORBIDDEN_CALLS or name.split(".")[0] in _FORBIDDEN_MODULES:
                found.append(f"{where} call {name}()")
            found += [f"{where} {name}({k.arg}=...)" for k in node.keywords
                      if k.arg in ("weights_only", "allow_pickle")]
    return found


def test_the_scanner_finds_every_kind_of_unsafe_construct():
    bad = ("import pickle\nfrom dill import loads\nimport torch\ntorch.load('x')\n"
           "torch.save(m, 'x')\neval('1')\nexec('x=1')\nnp.load('a', allow_pickle=True)\n"
           "f(weights_only=False)\n")
    assert len(unsafe_constructs(bad)) == 9
    assert unsafe_constructs("model.eval()\nre.compile('x')\nfrom towerflow import exec_step\n") == []


def test_the_source_tree_never_unpickles_or_executes_received_code():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30
    found = [hit for path in files
             for hit in unsafe_constructs(path.read_text(encoding="utf-8"), str(path.relative_to(SRC)))]
    assert found == []


@pytest.mark.slow
def test_unauthenticated_calls_are_refused_before_their_bodies_are_read(ps_process):
    import psutil

    spec, lc, ps = ps_process
    address = spec.task_address("ps", 0)
    server = psutil.Process(ps.pid)
    body = b"\0" * (60 << 20)

    def call(_: int) -> grpc.StatusCode:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length",
                                                      128 << 20)]) as channel:
            try:
                channel.unary_unary("/towerflow.ps.PS/Status")(body, timeout=30)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    baseline = server.memory_info().rss
    peak = baseline
    with futures.ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(call, i) for i in range(32)]
        while not all(c.done() for c in calls):
            peak = max(peak, server.memory_info().rss)
            time.sleep(0.005)  # sampling the ps's memory while the calls run
    assert {c.result() for c in calls} == {grpc.StatusCode.UNAUTHENTICATED}
    # 32 x 60 MiB were sent; a ps that read them before refusing grew by hundreds of MiB
    assert (peak - baseline) < 48 << 20, (baseline >> 20, peak >> 20)
    assert (server.memory_info().rss - baseline) < 24 << 20


@pytest.mark.slow
def test_towerflow_server_listens_wider_only_with_bind(subprocess_env, free_ports):
    import psutil

    from towerflow.cluster import ClusterSpec

    port = free_ports(1)[0]
    spec = ClusterSpec({"ps": [f"127.0.0.1:{port}"]})
    command = [sys.executable, "-m", "towerflow", "server"]
    with LocalCluster(spec, command, env=subprocess_env) as lc:
        refused = lc.start("ps", 0, extra_args=["--bind", "0.0.0.0"])
        assert refused.wait(timeout=60) != 0
        assert refused.find(r"non-loopback address 0\.0\.0\.0:\d+ in plaintext")
        wide = lc.start("ps", 0, extra_args=["--bind", "0.0.0.0", "--insecure"])
        wide.wait_for_line(r"ps task 0 serving at", timeout=60)
        listening = {c.laddr.ip for c in psutil.Process(wide.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening & {"0.0.0.0", "::"}, listening
    assert leftover_processes() == []
