"""A captured token is useless against another task, after a restart and with another body.

Real ``towerflow server`` ps processes on 127.0.0.1. The "sniffer" is a client
interceptor below the authenticating one: it sees exactly the metadata that
goes on the wire (and can keep a call from being sent, as an attacker on the
path that wins the race would).
"""

from __future__ import annotations

import sys
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from towerflow.cluster.auth import AUTH_METADATA_KEY, ClientAuth
from towerflow.cluster.transport import Credentials
from towerflow.errors import UnavailableError
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster

PUSH = "/towerflow.ps.PS/Push"
STATUS = "/towerflow.ps.PS/Status"


class _Sniffer(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Records the auth token of each call; with ``hold`` the call is not sent at all."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.hold = False

    def _record(self, details):  # type: ignore[no-untyped-def]
        self.tokens.append(dict(details.metadata)[AUTH_METADATA_KEY])
        if self.hold:
            raise _Held()

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        self._record(details)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[override]
        self._record(details)
        return continuation(details, request_iterator)


class _Held(Exception):
    pass


def _sniffed_channel(address: str, secret: bytes) -> tuple[grpc.Channel, _Sniffer]:
    raw = grpc.insecure_channel(address)
    sniffer = _Sniffer()
    return grpc.intercept_channel(grpc.intercept_channel(raw, sniffer),
                                  ClientAuth(secret, raw, address)), sniffer


def _push_messages(worker: int, seq: int, grad: np.ndarray) -> list[bytes]:
    head = pb.PushRequest(worker_id=worker, incarnation=1, seq=seq, lr=1.0, dtype="float32",
                          numel=grad.size).SerializeToString()
    return [head, grad.astype(np.float32).tobytes()]


def _replay(address: str, method: str, messages: list[bytes], token: str) -> grpc.StatusCode:
    """Send ``messages`` with a captured ``token`` through a bare channel; the status code."""
    with grpc.insecure_channel(address) as channel:
        try:
            if method == PUSH:
                channel.stream_unary(method)(iter(messages), timeout=10,
                                             metadata=((AUTH_METADATA_KEY, token),))
            else:
                channel.unary_unary(method)(messages[0], timeout=10,
                                            metadata=((AUTH_METADATA_KEY, token),))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def two_ps(subprocess_env):
    """Two real ps tasks with a cluster secret, initialised with one variable each."""
    spec = loopback_cluster(num_ps=2, num_workers=1)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        for i in range(2):
            lc.start("ps", i).wait_for_line(rf"ps task {i} serving at", timeout=60)
        honest = PSClient(spec, plan_placement({"a": (8,), "b": (8,)}, 2), worker_id=0,
                          credentials=lc.credentials, timeout=10.0)
        honest.initialize([np.zeros(8, np.float32)] * 2, optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig())
        try:
            yield spec, lc, honest
        finally:
            honest.close(done=False)
    assert leftover_processes() == []


def _once_reconnected(call, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    """``call()``, retried while the channel has not reconnected (a connection failure)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except (grpc.RpcError, UnavailableError) as exc:
            text = str(exc)
            if "restarted" in text or time.monotonic() > deadline:
                raise
            threading.Event().wait(0.1)


def _params(client: PSClient) -> list[np.ndarray]:
    out = [np.empty(8, np.float32) for _ in range(2)]
    client.pull(out)
    return out


@pytest.mark.slow
def test_a_token_sniffed_from_a_push_to_ps0_is_useless_at_ps1_and_with_another_body(two_ps):
    spec, lc, honest = two_ps
    ps0, ps1 = (spec.task_address("ps", i) for i in range(2))
    channel, sniffer = _sniffed_channel(ps0, lc.credentials.secret)
    honest_push = _push_messages(3, 1, np.ones(8))
    pb.PushReply.FromString(channel.stream_unary(PUSH)(iter(honest_push), timeout=10))
    token = sniffer.tokens[-1]
    before = _params(honest)
    evil = _push_messages(4, 1, np.full(8, 100.0))
    # to the other ps, with the attacker's body or the sniffed one
    assert _replay(ps1, PUSH, evil, token) == grpc.StatusCode.UNAUTHENTICATED
    assert _replay(ps1, PUSH, honest_push, token) == grpc.StatusCode.UNAUTHENTICATED
    # to the same ps again
    assert _replay(ps0, PUSH, evil, token) == grpc.StatusCode.UNAUTHENTICATED
    # an attacker on the path that keeps the honest call from arriving and sends its own body
    sniffer.hold = True
    with pytest.raises(_Held):
        channel.stream_unary(PUSH)(iter(_push_messages(3, 2, np.ones(8))), timeout=10)
    assert _replay(ps0, PUSH, evil, sniffer.tokens[-1]) == grpc.StatusCode.UNAUTHENTICATED
    for got, want in zip(_params(honest), before, strict=True):
        np.testing.assert_array_equal(got, want)
    lc.task("ps", 0).wait_for_line(r"request is not the one its credentials were issued for|"
                                   r"refused call to /towerflow\.ps\.PS/Push", timeout=10)
    channel.close()


@pytest.mark.slow
def test_a_token_from_before_a_ps_restart_is_refused_after_it(two_ps):
    spec, lc, honest = two_ps
    ps0 = spec.task_address("ps", 0)
    channel, sniffer = _sniffed_channel(ps0, lc.credentials.secret)
    assert pb.StatusReply.FromString(channel.unary_unary(STATUS)(b"", timeout=10)).initialized
    sniffer.hold = True  # a token minted, captured and never used
    with pytest.raises(_Held):
        channel.unary_unary(STATUS)(b"", timeout=10)
    unused = sniffer.tokens[-1]
    sniffer.hold = False
    ps = lc.task("ps", 0)
    ps.kill()
    ps.restart().wait_for_line(r"ps task 0 serving at", timeout=60)
    # the restarted task remembers no nonce, yet the token names the incarnation that is gone
    assert _replay(ps0, STATUS, [b""], unused) == grpc.StatusCode.UNAVAILABLE
    assert _replay(ps0, STATUS, [b""], sniffer.tokens[0]) == grpc.StatusCode.UNAVAILABLE
    assert ps.wait_for_line(r"restarted since the call was signed", timeout=10)
    # the honest channel learns the new incarnation and goes on
    reply = _once_reconnected(lambda: channel.unary_unary(STATUS)(b"", timeout=10))
    assert not pb.StatusReply.FromString(reply).initialized
    channel.close()


def test_the_client_learns_the_server_identity_once_and_again_after_a_restart(free_ports):
    from towerflow.cluster import Server
    from towerflow.cluster.server import PING_METHOD
    from towerflow.cluster.transport import make_channel, unary

    address = f"127.0.0.1:{free_ports(1)[0]}"
    creds = Credentials(secret=b"identity-secret")
    server = Server({"ps": [address]}, "ps", 0, credentials=creds, services=None)
    channel = make_channel(address, creds)
    try:
        unary(channel, PING_METHOD, b"", timeout=10)
        first = server._auth.identity
        server.stop(0)
        server = Server({"ps": [address]}, "ps", 0, credentials=creds, services=None)
        assert server._auth.identity.incarnation != first.incarnation
        # refused by the new incarnation before it ran, then retried once with a new handshake
        reply = _once_reconnected(lambda: unary(channel, PING_METHOD, b"", timeout=10))
        assert b'"job": "ps"' in reply
    finally:
        channel.close()
        server.stop(0)


# --------------------------------------------------------------------------- downgrade
def test_a_client_with_a_secret_refuses_a_server_without_one_and_sends_it_nothing(free_ports):
    from towerflow.cluster import Server
    from towerflow.cluster.transport import make_channel, raw_handlers, unary
    from towerflow.errors import UnauthenticatedError

    calls: list[bytes] = []
    rogue_service = raw_handlers("towerflow.ps.PS", {"Status": ("unary_unary", calls.append)})
    address = f"127.0.0.1:{free_ports(1)[0]}"
    rogue = Server({"ps": [address]}, "ps", 0, credentials=Credentials(), services=None,
                   handlers=[rogue_service])
    channel = make_channel(address, Credentials(secret=b"cluster-secret"))
    try:
        with pytest.raises(UnauthenticatedError,
                           match=r"refusing the task at 127\.0\.0\.1:\d+: it answered the "
                                 r"handshake with UNIMPLEMENTED, so it holds no cluster secret"):
            unary(channel, STATUS, b"gradients", timeout=10)
        assert calls == []
    finally:
        channel.close()
        rogue.stop(0)


@pytest.fixture
def secret_server(free_ports):
    from towerflow.cluster import Server

    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = Server({"ps": [address]}, "ps", 0, credentials=Credentials(secret=b"s3"),
                    services=None)
    try:
        yield address, server
    finally:
        server.stop(0)


def _hello(address: str, metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, bytes]:
    from towerflow.cluster.auth import HELLO_METHOD

    with grpc.insecure_channel(address) as channel:
        try:
            return grpc.StatusCode.OK, channel.unary_unary(HELLO_METHOD)(b"", timeout=10,
                                                                         metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), (exc.details() or "").encode()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(proof=st.text(alphabet="0123456789abcdef:", max_size=90))
def test_the_handshake_tells_nothing_to_a_caller_without_the_secret(secret_server, proof):
    address, server = secret_server
    challenge = "ab" * 16
    code, said = _hello(address, (("x-towerflow-challenge", challenge),
                                  ("x-towerflow-hello", proof)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert b"handshake refused" in said
    assert server._auth.identity.incarnation.encode() not in said
    assert b"/job:ps" not in said


def test_a_handshake_proof_works_once_and_only_with_the_secret(secret_server):
    from towerflow.cluster.auth import _mac

    address, server = secret_server
    challenge, stamp = "cd" * 16, str(int(time.time()))
    wrong = f"{stamp}:{_mac(b'other', 'hello-client', challenge, stamp)}"
    right = f"{stamp}:{_mac(b's3', 'hello-client', challenge, stamp)}"
    meta = (("x-towerflow-challenge", challenge),)
    assert _hello(address, (*meta, ("x-towerflow-hello", wrong)))[0] == grpc.StatusCode.UNAUTHENTICATED
    code, said = _hello(address, (*meta, ("x-towerflow-hello", right)))
    assert code == grpc.StatusCode.OK and server._auth.identity.incarnation.encode() in said
    code, said = _hello(address, (*meta, ("x-towerflow-hello", right)))
    assert code == grpc.StatusCode.UNAUTHENTICATED and b"replayed" in said
