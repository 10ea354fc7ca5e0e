"""Transport: authentication on every call, TLS / mutual TLS, deadlines, error mapping."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from towerflow.cluster import Credentials, Server, TLSConfig
from towerflow.cluster.auth import ServerIdentity, make_token
from towerflow.cluster.server import ServerOptions
from towerflow.cluster.transport import (
    AuthInterceptor,
    ChannelOptions,
    make_channel,
    raw_handlers,
    read_secret_file,
    stream_unary,
    unary,
    unary_stream,
    write_secret_file,
)
from towerflow.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

SECRET = b"0123456789abcdef-cluster-secret"


class Counter:
    """Counts handler invocations, to prove refused calls never reach a handler."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def echo(self, request: bytes) -> bytes:
        with self.lock:
            self.calls += 1
        return request[::-1]

    def concat(self, requests) -> bytes:
        with self.lock:
            self.calls += 1
        digest = hashlib.sha256()
        for request in requests:
            digest.update(request)
        return digest.digest()

    def split(self, request: bytes):
        with self.lock:
            self.calls += 1
        for i in range(0, len(request), 2):
            yield request[i : i + 2]


def _service(counter: Counter, **extra) -> object:
    methods = {
        "Echo": ("unary_unary", counter.echo),
        "Concat": ("stream_unary", counter.concat),
        "Split": ("unary_stream", counter.split),
        **extra,
    }
    return raw_handlers("test.Svc", methods)


@pytest.fixture
def served(free_ports):
    """A running authenticated server with the test service; yields (address, counter)."""
    counter = Counter()
    address = f"127.0.0.1:{free_ports(1)[0]}"
    release = threading.Event()

    def block(request: bytes) -> bytes:
        release.wait(30)
        return b"late"

    def not_found(request: bytes) -> bytes:
        raise NotFoundError("variable 'w' is not on this shard")

    def crash(request: bytes) -> bytes:
        raise RuntimeError("boom")

    server = Server(
        {"local": [address]},
        "local",
        0,
        credentials=Credentials(secret=SECRET),
        handlers=[
            _service(
                counter,
                Block=("unary_unary", block),
                Missing=("unary_unary", not_found),
                Crash=("unary_unary", crash),
            )
        ],
        options=ServerOptions(channel=ChannelOptions(max_message_bytes=1 << 20)),
    )
    try:
        yield address, counter
    finally:
        release.set()
        server.stop(0)


def test_authenticated_unary_call_reaches_handler(served):
    address, counter = served
    channel = make_channel(address, Credentials(secret=SECRET))
    try:
        assert unary(channel, "/test.Svc/Echo", b"abc", timeout=10) == b"cba"
    finally:
        channel.close()
    assert counter.calls == 1


@pytest.mark.parametrize("secret", [None, b"not-the-cluster-secret"], ids=["missing", "wrong"])
def test_call_without_or_with_wrong_secret_is_refused_before_the_handler(served, secret):
    address, counter = served
    channel = make_channel(address, Credentials(secret=secret))
    try:
        with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED.*(no|wrong) credentials"):
            unary(channel, "/test.Svc/Echo", b"abc", timeout=10)
        with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED"):
            stream_unary(channel, "/test.Svc/Concat", [b"a", b"b"], timeout=10)
        with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED"):
            list(unary_stream(channel, "/test.Svc/Split", b"abcd", timeout=10))
    finally:
        channel.close()
    assert counter.calls == 0


def test_streams_carry_a_payload_larger_than_the_message_limit_in_chunks(served):
    address, counter = served
    payload = os.urandom(3 << 20)  # three times the server's 1 MiB message limit
    channel = make_channel(address, Credentials(secret=SECRET))
    try:
        chunks = [memoryview(payload)[i : i + (256 << 10)] for i in range(0, len(payload), 256 << 10)]
        reply = stream_unary(channel, "/test.Svc/Concat", chunks, timeout=30)
        assert reply == hashlib.sha256(payload).digest()
        assert b"".join(unary_stream(channel, "/test.Svc/Split", b"abcdefg", timeout=10)) == b"abcdefg"
    finally:
        channel.close()
    assert counter.calls == 2


def test_oversize_message_is_refused_with_resource_exhausted(served):
    address, counter = served
    channel = make_channel(address, Credentials(secret=SECRET), max_message_bytes=8 << 20)
    try:
        with pytest.raises(ResourceExhaustedError, match="RESOURCE_EXHAUSTED.*in chunks"):
            unary(channel, "/test.Svc/Echo", bytes(2 << 20), timeout=10)
    finally:
        channel.close()
    assert counter.calls == 0


def test_handler_errors_map_to_towerflow_errors(served):
    address, _ = served
    channel = make_channel(address, Credentials(secret=SECRET))
    try:
        with pytest.raises(NotFoundError, match="NOT_FOUND: variable 'w' is not on this shard"):
            unary(channel, "/test.Svc/Missing", b"", timeout=10)
        with pytest.raises(InternalError, match="INTERNAL.*RuntimeError: boom"):
            unary(channel, "/test.Svc/Crash", b"", timeout=10)
    finally:
        channel.close()


def test_deadline_exceeded_maps_to_deadline_exceeded_error(served):
    address, _ = served
    channel = make_channel(address, Credentials(secret=SECRET))
    try:
        with pytest.raises(DeadlineExceededError, match="DEADLINE_EXCEEDED"):
            unary(channel, "/test.Svc/Block", b"", timeout=0.3)
    finally:
        channel.close()


def test_unreachable_peer_raises_unavailable_within_the_deadline(free_ports):
    channel = make_channel(f"127.0.0.1:{free_ports(1)[0]}", Credentials(secret=SECRET))
    start = time.monotonic()
    try:
        with pytest.raises(UnavailableError, match=r"UNAVAILABLE.*check that the task is running"):
            unary(channel, "/test.Svc/Echo", b"", timeout=20)
    finally:
        channel.close()
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("timeout", [None, 0, -1.0, float("inf")])
def test_every_call_needs_a_finite_deadline(served, timeout):
    address, counter = served
    channel = make_channel(address, Credentials(secret=SECRET))
    try:
        with pytest.raises(InvalidArgumentError, match="needs a finite positive deadline"):
            unary(channel, "/test.Svc/Echo", b"", timeout=timeout)
    finally:
        channel.close()
    assert counter.calls == 0


def test_auth_token_cannot_be_replayed_reused_for_another_method_or_used_late():
    interceptor = AuthInterceptor(SECRET, freshness=60, task="/job:ps/replica:0/task:0")
    now = 1_700_000_000.0
    token = make_token(SECRET, "/test.Svc/Echo", interceptor.identity, b"body", now=now)
    assert interceptor.check("/test.Svc/Other", token, now=now).startswith("wrong credentials")
    assert interceptor.check("/test.Svc/Echo", token, now=now + 61) == (
        "expired credentials (check the clocks)"
    )
    assert interceptor.check("/test.Svc/Echo", token, now=now) is None
    assert interceptor.check("/test.Svc/Echo", token, now=now + 1) == "replayed credentials"
    assert interceptor.check("/test.Svc/Echo", "v1:garbage", now=now) == "malformed credentials"


def test_auth_token_is_bound_to_the_task_and_the_incarnation_it_was_issued_for():
    ps0 = AuthInterceptor(SECRET, task="/job:ps/replica:0/task:0")
    ps1 = AuthInterceptor(SECRET, task="/job:ps/replica:0/task:1")
    token = make_token(SECRET, "/test.Svc/Echo", ps0.identity)
    assert ps1.check("/test.Svc/Echo", token).startswith("wrong credentials")
    # the same task after a restart: a new incarnation, no remembered nonces
    restarted = AuthInterceptor(SECRET, task="/job:ps/replica:0/task:0")
    assert restarted.identity.incarnation != ps0.identity.incarnation
    verdict = restarted.verify("/test.Svc/Echo", token)
    assert "restarted since the call was signed" in verdict.reason
    assert verdict.code.name == "UNAVAILABLE"
    # a token for an identity nobody has
    forged = make_token(SECRET, "/test.Svc/Echo", ServerIdentity("/job:ps/replica:0/task:0", "0"))
    assert "restarted" in ps0.check("/test.Svc/Echo", forged)
    assert ps0.check("/test.Svc/Echo", token) is None


def test_forgotten_nonces_refuse_tokens_older_than_the_oldest_remembered(monkeypatch):
    import towerflow.cluster.auth as auth

    monkeypatch.setattr(auth, "_MAX_SEEN_NONCES", 3)
    check = AuthInterceptor(SECRET, freshness=60)
    now = 1_700_000_000.0
    tokens = [make_token(SECRET, "/m", check.identity, now=now + i) for i in range(5)]
    assert [check.check("/m", t, now=now + 5) for t in tokens] == [None] * 5
    # the first two were forgotten to keep the memory bounded: their replays are still refused
    assert check.check("/m", tokens[0], now=now + 5).startswith("expired")
    assert check.check("/m", tokens[4], now=now + 5) == "replayed credentials"


def test_credentials_from_env_reads_secret_file_and_tls_paths(tmp_path):
    path = write_secret_file(tmp_path / "secret", b"abc123\n")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    creds = Credentials.from_env(
        {"TOWERFLOW_SECRET_FILE": str(path), "TOWERFLOW_TLS_CA": "/x/ca.pem"}
    )
    assert creds.secret == b"abc123"
    assert creds.tls == TLSConfig(ca=Path("/x/ca.pem"))
    assert "abc123" not in repr(creds)
    assert Credentials.from_env({"TOWERFLOW_SECRET": "s", "TOWERFLOW_SECRET_FILE": str(path)}).secret == b"s"
    with pytest.raises(NotFoundError, match="secret file '.*nope' does not exist"):
        read_secret_file(tmp_path / "nope")


# --------------------------------------------------------------------------- TLS
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed_cert(name: str, cwd: Path, san: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)  # fmt: skip
    (cwd / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=cwd)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A throwaway CA with a server certificate (localhost) and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cwd = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca",
             cwd=cwd)  # fmt: skip
    _signed_cert("server", cwd, "DNS:localhost,IP:127.0.0.1")
    _signed_cert("client", cwd, "DNS:worker0")
    return cwd


def _accepts_one_client_and_refuses_the_other(
    address: str, server_tls: TLSConfig, accepted: Credentials, refused: Credentials
) -> None:
    """The TLS server answers ``accepted``; ``refused`` never reaches the handler."""
    counter = Counter()
    server = Server({"local": [address]}, "local", 0, credentials=Credentials(tls=server_tls),
                    handlers=[_service(counter)])  # fmt: skip
    good = make_channel(address, accepted)
    bad = make_channel(address, refused)
    try:
        assert unary(good, "/test.Svc/Echo", b"xy", timeout=20) == b"yx"
        with pytest.raises(UnavailableError):
            unary(bad, "/test.Svc/Echo", b"xy", timeout=5)
    finally:
        good.close()
        bad.close()
        server.stop(0)
    assert counter.calls == 1


def test_tls_call_works_and_plaintext_client_is_refused(certs, free_ports):
    _accepts_one_client_and_refuses_the_other(
        f"localhost:{free_ports(1)[0]}",
        TLSConfig(cert=certs / "server.pem", key=certs / "server.key"),
        accepted=Credentials(tls=TLSConfig(ca=certs / "ca.pem")),
        refused=Credentials(),
    )


def test_mutual_tls_accepts_a_client_certificate_and_refuses_a_client_without_one(certs, free_ports):
    client_tls = TLSConfig(cert=certs / "client.pem", key=certs / "client.key", ca=certs / "ca.pem")
    _accepts_one_client_and_refuses_the_other(
        f"localhost:{free_ports(1)[0]}",
        TLSConfig(cert=certs / "server.pem", key=certs / "server.key", ca=certs / "ca.pem"),
        accepted=Credentials(tls=client_tls),
        refused=Credentials(tls=TLSConfig(ca=certs / "ca.pem")),
    )


def test_fixed_stream_window_still_carries_messages_many_times_its_size(free_ports):
    options = ChannelOptions()
    assert options.stream_window_bytes == 2 << 20
    assert ("grpc.http2.bdp_probe", 0) in options.server_options()
    assert ("grpc.http2.lookahead_bytes", 2 << 20) in options.grpc_options()
    assert not any(key.startswith("grpc.http2.bdp")
                   for key, _ in ChannelOptions(stream_window_bytes=None).server_options())
    counter = Counter()
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = Server({"local": [address]}, "local", 0, credentials=Credentials(secret=SECRET),
                    handlers=[_service(counter)], options=ServerOptions(channel=options))
    channel = make_channel(address, Credentials(secret=SECRET), options=options)
    try:
        big = os.urandom(24 << 20)  # 12 windows in one message
        assert unary(channel, "/test.Svc/Echo", big, timeout=30) == big[::-1]
        chunks = [big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]
        assert stream_unary(channel, "/test.Svc/Concat", iter(chunks),
                            timeout=30) == hashlib.sha256(big).digest()
    finally:
        channel.close()
        server.stop(0)
    assert counter.calls == 2
