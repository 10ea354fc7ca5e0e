"""Server: one gRPC server per task, waiting for peers, binding rules, lifecycle."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from test_security import _public_address

from towerflow.cluster import ClusterSpec, Credentials, Server, ServerOptions, TLSConfig
from towerflow.cluster.transport import make_channel, raw_handlers, unary
from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from towerflow.testing import wait_until

SECRET = Credentials(secret=b"server-test-secret")


def test_target_and_ping_of_a_two_task_cluster(free_ports):
    a, b = free_ports(2)
    cluster = ClusterSpec({"local": [f"localhost:{a}", f"localhost:{b}"]})
    with Server(cluster, "local", 0, credentials=SECRET) as s0, Server(cluster, "local", 1, credentials=SECRET) as s1:
        assert s0.target == f"grpc://localhost:{a}"
        assert s0.ping("local", 1)["task"] == 1
        assert s1.ping("local", 0)["job"] == "local"


def test_wait_for_peers_logs_retries_until_the_peer_starts(free_ports, caplog):
    a, b = free_ports(2)
    cluster = ClusterSpec({"ps": [f"localhost:{a}"], "worker": [f"localhost:{b}"]})
    ps = Server(cluster, "ps", 0, credentials=SECRET)
    worker = None
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            ps.wait_for_peers(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    caplog.set_level(logging.INFO, logger="towerflow.cluster")
    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        line = f"waiting for /job:worker/replica:0/task:0 at localhost:{b} (failed to connect; retrying)"
        wait_until(lambda: line in caplog.text, timeout=20.0, what="the log line")
        assert waiter.is_alive()
        worker = Server(cluster, "worker", 0, credentials=SECRET)
        waiter.join(30)
        assert not waiter.is_alive() and errors == []
    finally:
        ps.stop(0)
        if worker is not None:
            worker.stop(0)
        waiter.join(30)


def test_wait_for_peers_gives_up_naming_the_missing_tasks(free_ports):
    a, b, c = free_ports(3)
    cluster = ClusterSpec({"ps": [f"localhost:{a}"], "worker": [f"localhost:{b}", f"localhost:{c}"]})
    with Server(cluster, "worker", 0, credentials=SECRET) as server:
        with pytest.raises(
            UnavailableError,
            match=rf"gave up after 0.5 s waiting for /job:ps/replica:0/task:0 at localhost:{a} "
            rf"\(failed to connect\), /job:worker/replica:0/task:1 at localhost:{c}",
        ):
            server.wait_for_peers(timeout=0.5)
        with pytest.raises(InvalidArgumentError, match="job 'chief' is not in the cluster"):
            server.wait_for_peers(jobs=["chief"], timeout=0.5)


def test_wait_for_peers_stops_at_once_when_a_peer_refuses_our_secret(free_ports):
    a, b = free_ports(2)
    cluster = ClusterSpec({"local": [f"localhost:{a}", f"localhost:{b}"]})
    with Server(cluster, "local", 0, credentials=SECRET) as s0, Server(
        cluster, "local", 1, credentials=Credentials(secret=b"other")
    ):
        with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED.*same cluster secret"):
            s0.wait_for_peers(timeout=30)


def test_a_peer_with_another_cluster_spec_is_reported(free_ports):
    a, b = free_ports(2)
    mine = ClusterSpec({"local": [f"localhost:{a}", f"localhost:{b}"]})
    theirs = ClusterSpec({"other": [f"localhost:{b}"]})
    with Server(mine, "local", 0, credentials=SECRET) as server, Server(theirs, "other", 0, credentials=SECRET):
        with pytest.raises(InvalidArgumentError, match=rf"task at localhost:{b} is /job:other/replica:0/task:0"):
            server.wait_for_peers(timeout=30)


def test_refuses_a_non_loopback_address_without_authentication(caplog):
    cluster = {"ps": ["10.1.2.3:2222"]}
    with pytest.raises(InvalidArgumentError, match="refusing to serve /job:ps/replica:0/task:0 on non-loopback address 10.1.2.3:2222 without authentication"):
        Server(cluster, "ps", 0, credentials=Credentials(), start=False)
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"):
        Server(cluster, "ps", 0, credentials=Credentials(insecure=True), start=False)
    assert "WITHOUT authentication (insecure)" in caplog.text


def test_refuses_a_non_loopback_address_in_plaintext_unless_told_so(caplog):
    cluster = {"ps": ["10.1.2.3:2222"]}
    with pytest.raises(InvalidArgumentError, match=r"on non-loopback address 10\.1\.2\.3:2222 in "
                       r"plaintext \(without TLS\); set a cluster secret .* and TLS"):
        Server(cluster, "ps", 0, credentials=SECRET, start=False)
    tls = TLSConfig(cert=Path("server.pem"), key=Path("server.key"))
    Server(cluster, "ps", 0, credentials=Credentials(secret=b"s", tls=tls), start=False)
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"):
        Server(cluster, "ps", 0, credentials=Credentials(secret=b"s", insecure=True), start=False)
    assert "10.1.2.3:2222 in plaintext (insecure): calls are authenticated" in caplog.text


def test_binds_the_address_its_spec_names_and_wider_only_when_told(free_ports):
    host = _public_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = free_ports(1)[0]
    spec = {"ps": [f"{host}:{port}"]}
    insecure = Credentials(secret=b"s", insecure=True)
    with Server(spec, "ps", 0, credentials=insecure, services=None):
        assert _listening(port) == {host}  # not every interface
    wide = ServerOptions(bind_host="0.0.0.0")
    with pytest.raises(InvalidArgumentError, match=r"address 0\.0\.0\.0:\d+ in plaintext"):
        Server({"ps": [f"127.0.0.1:{port}"]}, "ps", 0, credentials=SECRET, options=wide)
    with Server(spec, "ps", 0, credentials=insecure, options=wide, services=None):
        assert _listening(port) & {"0.0.0.0", "::"}  # every interface (gRPC may go dual-stack)


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket of this process listens on at ``port``."""
    import psutil

    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_handlers_are_added_before_start_and_refused_after(free_ports):
    port = free_ports(1)[0]
    server = Server({"worker": [f"localhost:{port}"]}, "worker", 0, credentials=SECRET, start=False)
    server.add_handlers([raw_handlers("t.Hello", {"Hi": ("unary_unary", lambda r: b"hi " + r)})])
    server.start()
    channel = make_channel(server.address, SECRET)
    try:
        assert unary(channel, "/t.Hello/Hi", b"there", timeout=10) == b"hi there"
        with pytest.raises(FailedPreconditionError, match="already started; add handlers before start"):
            server.add_handlers([])
    finally:
        channel.close()
        server.stop(0)


def test_a_taken_port_is_an_error_not_a_shared_port(free_ports):
    port = free_ports(1)[0]
    cluster = {"worker": [f"localhost:{port}"]}
    with Server(cluster, "worker", 0, credentials=SECRET):
        with pytest.raises(UnavailableError, match=f"cannot listen on localhost:{port} for /job:worker"):
            Server(cluster, "worker", 0, credentials=SECRET)


def test_join_returns_when_stop_is_called(free_ports):
    server = Server({"ps": [f"localhost:{free_ports(1)[0]}"]}, "ps", 0, credentials=SECRET)
    joiner = threading.Thread(target=server.join)
    joiner.start()
    try:
        assert joiner.is_alive()
        server.stop(0)
        joiner.join(10)
        assert not joiner.is_alive() and server.stopped
    finally:
        server.stop(0)
        joiner.join(10)


def test_towerflow_server_command_serves_until_sigterm(python, free_ports, subprocess_env, tmp_path):
    import json
    import signal
    import subprocess

    port = free_ports(1)[0]
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"worker": [f"localhost:{port}"]}))
    secret = tmp_path / "secret"
    secret.write_bytes(b"cli-secret")
    secret.chmod(0o600)
    process = subprocess.Popen(
        [python, "-m", "towerflow", "server", "--cluster", str(cluster), "--job", "worker",
         "--task", "0", "--secret-file", str(secret)],
        env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        serving = f"serving /job:worker/replica:0/task:0 at grpc://localhost:{port}"
        seen = [process.stdout.readline().strip() for _ in range(2)]  # log line + print
        assert serving in seen, seen
        channel = make_channel(f"localhost:{port}", Credentials(secret=b"cli-secret"))
        try:
            assert b'"job": "worker"' in unary(channel, "/towerflow.cluster.Control/Ping", b"", timeout=20)
        finally:
            channel.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def test_towerflow_server_command_refuses_a_public_address_without_secret(tmp_path, monkeypatch, capsys):
    import json

    from towerflow.cli import main

    for name in ("TOWERFLOW_SECRET", "TOWERFLOW_SECRET_FILE", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"ps": ["10.1.2.3:2222"]}))
    assert main(["server", "--cluster", str(cluster), "--job", "worker"]) == 2
    assert "job 'worker' is not in the cluster" in capsys.readouterr().err
    cluster.write_text(json.dumps({"worker": ["10.1.2.3:2222"]}))
    assert main(["server", "--cluster", str(cluster), "--job", "worker", "--task", "0"]) == 2
    assert "without authentication; set a cluster secret" in capsys.readouterr().err


def test_towerflow_server_command_hosts_the_ps_service_on_a_ps_task(python, free_ports, subprocess_env, tmp_path):
    import json
    import signal
    import subprocess

    from towerflow.ps.wire.calls import SERVICE_NAME

    port = free_ports(1)[0]
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"ps": [f"localhost:{port}"], "worker": [f"localhost:{free_ports(1)[0]}"]}))
    env = {**subprocess_env, "TOWERFLOW_SECRET": "ps-secret"}
    process = subprocess.Popen(
        [python, "-m", "towerflow", "server", "--cluster", str(cluster), "--job", "ps", "--task", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    channel = make_channel(f"localhost:{port}", Credentials(secret=b"ps-secret"))
    try:
        deadline = time.monotonic() + 60
        while True:  # poll until the task is up
            try:
                unary(channel, f"/{SERVICE_NAME}/Status", b"", timeout=5)
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                threading.Event().wait(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def test_any_task_opts_in_to_plaintext_off_loopback_through_the_environment(caplog):
    cluster = {"worker": ["10.1.2.3:2222"]}
    with pytest.raises(InvalidArgumentError, match=r"TOWERFLOW_INSECURE=1 for any task"):
        Server(cluster, "worker", 0, credentials=Credentials.from_env({"TOWERFLOW_SECRET": "s"}),
               start=False)
    creds = Credentials.from_env({"TOWERFLOW_SECRET": "s", "TOWERFLOW_INSECURE": "1"})
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"):
        Server(cluster, "worker", 0, credentials=creds, start=False)
    assert "10.1.2.3:2222 in plaintext (insecure)" in caplog.text
    with pytest.raises(InvalidArgumentError, match=r"TOWERFLOW_INSECURE='yes' is not 0 or 1"):
        Credentials.from_env({"TOWERFLOW_INSECURE": "yes"})
