"""The ZeroMQ carriers of ``transport_compare.py``: plain, CURVE, and HMAC-sealed messages.

Every candidate here is a pyzmq ROUTER server and DEALER clients, multipart frames,
``copy=False`` both ways; the server loop of ``zmq`` and ``zmq-curve`` is the same code:

* ``zmq``: ``[tag, payload]`` out, ``[tag, reply]`` back (``tag``: the kind's code and 1 on a
  dense round's last chunk);
* ``zmq-curve``: ``zmq`` over ZeroMQ's CURVE mechanism (Curve25519 key exchange with
  ephemeral session keys, then XSalsa20-Poly1305 on every message, in libzmq's I/O thread):
  every message is encrypted and authenticated, and replays are refused (a per-session nonce
  counter). The long-term keys come from the cluster secret (``curve_keys``); the server
  admits only the client key of that secret (a ZAP handler, ``ThreadAuthenticator``, in the
  server process), so a client with another key gets no answer;
* ``zmq-hmac``: ``[head, mac, payload]``: ``head`` is the tag and a 64-bit counter per
  direction (a receiver takes only the next one: no replays within a connection), ``mac`` is
  HMAC-SHA256 of ``head`` alone, with a key of the secret per direction: the header is
  authenticated, the payload is not (nothing is encrypted);
* ``zmq-hmac-body``: ``zmq-hmac`` with the MAC over ``head`` and the payload frame(s):
  every byte authenticated, in Python (``hmac``, OpenSSL), by the server before it answers
  and by the client for each reply.

The server and client here are run by ``transport_peers.py``; ``handshake`` is a CURVE
client of its own, for the check that a client with another key is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import struct
import sys
import threading
from collections.abc import Callable

from transport_peers import CODE, DENSE, KINDS, Rounds  # the same directory

SECRET = b"bench-secret"  # the cluster secret of the benchmark
SEALED = {"zmq-hmac": False, "zmq-hmac-body": True}  # candidate: the MAC covers the payload
HEAD = struct.Struct("<BBQ")  # kind code, 1 on a dense round's last chunk, counter


def curve_keys(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """A z85 ``(public, secret)`` CURVE key pair of the cluster secret for ``role`` (``server``,
    ``client``): the secret key is HMAC-SHA256(secret, b"towerflow-zmq-" + role)'s 32 bytes."""
    import zmq
    from zmq.utils import z85

    raw = hmac.new(secret, b"towerflow-zmq-" + role.encode(), hashlib.sha256).digest()[:32]
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def mac_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The HMAC keys of the cluster secret: requests, replies (one per direction)."""
    return tuple(hmac.new(secret, b"towerflow-zmq-hmac-" + way, hashlib.sha256).digest()
                 for way in (b"request", b"reply"))


class Sealer:
    """Seals one direction's messages: the next counter, the MAC of the head (and payload)."""

    def __init__(self, key: bytes, body: bool) -> None:
        self.key, self.body, self.counter = key, body, 0

    def seal(self, code: int, last: int, payload: bytes) -> list:
        self.counter += 1
        head = HEAD.pack(code, last, self.counter)
        mac = hmac.new(self.key, head, hashlib.sha256)
        if self.body:
            mac.update(payload)
        return [head, mac.digest(), payload]


class Opener:
    """Checks one direction's messages: the MAC, and that the counter is the next one."""

    def __init__(self, key: bytes, body: bool) -> None:
        self.key, self.body, self.counter = key, body, 0

    def open(self, head, mac, payloads: list) -> tuple[int, int] | None:  # noqa: ANN001 - Frames
        """``(code, last)``, or None for a message that is forged, replayed or out of order."""
        head = head.bytes
        check = hmac.new(self.key, head, hashlib.sha256)
        if self.body:
            for frame in payloads:
                check.update(frame.buffer)
        code, last, counter = HEAD.unpack(head)
        if not hmac.compare_digest(check.digest(), mac.bytes) or counter != self.counter + 1:
            return None
        self.counter = counter
        return code, last


# ----------------------------------------------------------------------------- the server
def serve_zmq(candidate: str, replies: dict[str, bytes], args: argparse.Namespace,
              ready: Callable[[int], None]) -> None:
    import zmq

    out = {CODE[kind]: reply for kind, reply in replies.items()}
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    auth = None
    if candidate == "zmq-curve":
        auth = curve_server(context, sock, SECRET)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    def end() -> None:  # stdin closed: end the context; the loop's recv raises ContextTerminated
        sys.stdin.read()
        if auth is not None:
            auth.stop()  # its sockets are the context's too
        context.term()

    threading.Thread(target=end, daemon=True).start()
    ready(port)
    try:
        if candidate in SEALED:
            sealed_loop(sock, out, SEALED[candidate])
        else:
            plain_loop(sock, out)
    except zmq.ContextTerminated:
        pass
    finally:
        sock.close(0)


def curve_server(context, sock, secret: bytes):  # noqa: ANN001, ANN201 - zmq objects
    """Make ``sock`` (not bound yet) a CURVE server with the secret's server keys; a ZAP
    handler in ``context`` admits the secret's client key alone. Returns the handler."""
    from zmq.auth.thread import ThreadAuthenticator

    client_public, _ = curve_keys(secret, "client")

    class OneKey:
        def callback(self, domain: str, key: bytes) -> bool:  # noqa: ARG002 - any domain
            return hmac.compare_digest(key, client_public)

    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=OneKey())
    public, secret_key = curve_keys(secret, "server")
    sock.curve_secretkey, sock.curve_publickey = secret_key, public
    sock.curve_server = True
    return auth


def plain_loop(sock, out: dict[int, bytes]) -> None:  # noqa: ANN001 - a zmq socket
    rounds: dict[bytes, Rounds] = {}
    while True:
        peer, tag, _payload = sock.recv_multipart(copy=False)
        peer_id, (code, last) = peer.bytes, tag.bytes
        for _ in range(rounds.setdefault(peer_id, Rounds()).replies(code, last)):
            sock.send_multipart([peer_id, bytes((code, 0)), out[code]], copy=False)


def sealed_loop(sock, out: dict[int, bytes], body: bool) -> None:  # noqa: ANN001 - a zmq socket
    """Each message checked before it counts (one that fails is dropped); each reply sealed."""
    request_key, reply_key = mac_keys(SECRET)
    peers: dict[bytes, tuple[Rounds, Opener, Sealer]] = {}
    while True:
        peer, head, mac, *payloads = sock.recv_multipart(copy=False)
        peer_id = peer.bytes
        if peer_id not in peers:
            peers[peer_id] = Rounds(), Opener(request_key, body), Sealer(reply_key, body)
        rounds, opener, sealer = peers[peer_id]
        if (opened := opener.open(head, mac, payloads)) is None:
            continue
        code, last = opened
        for _ in range(rounds.replies(code, last)):
            sock.send_multipart([peer_id, *sealer.seal(code, 0, out[code])], copy=False)


# ----------------------------------------------------------------------------- the clients
class ZmqClient:
    """A DEALER socket; ``[tag, payload]`` out, ``[tag, reply]`` back, no copies; with
    ``curve``, a CURVE client with the secret's client keys."""

    def __init__(self, port: int, sent: dict[str, tuple[bytes, bytes]],
                 curve: bool = False) -> None:
        import zmq

        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            curve_client(self.sock, curve_keys(SECRET, "client"),
                         curve_keys(SECRET, "server")[0])
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.requests = {kind: request for kind, (request, _) in sent.items()}
        self.tags = {kind: bytes((CODE[kind], 0)) for kind in KINDS}
        self.last_tag = bytes((DENSE, 1))

    def round(self, kind: str, chunks: int) -> None:
        request = self.requests[kind]
        for index in range(chunks):
            tag = self.last_tag if kind == "dense" and index == chunks - 1 else self.tags[kind]
            self.sock.send_multipart([tag, request], copy=False)
        for _ in range(chunks):
            self.sock.recv_multipart(copy=False)

    def end_phase(self) -> None:
        pass

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


class SealedClient(ZmqClient):
    """``zmq-hmac`` / ``zmq-hmac-body``: requests sealed, each reply checked."""

    def __init__(self, port: int, sent: dict[str, tuple[bytes, bytes]], body: bool) -> None:
        super().__init__(port, sent)
        request_key, reply_key = mac_keys(SECRET)
        self.sealer, self.opener = Sealer(request_key, body), Opener(reply_key, body)

    def round(self, kind: str, chunks: int) -> None:
        request, code = self.requests[kind], CODE[kind]
        for index in range(chunks):
            last = int(kind == "dense" and index == chunks - 1)
            self.sock.send_multipart(self.sealer.seal(code, last, request), copy=False)
        for _ in range(chunks):
            head, mac, *payloads = self.sock.recv_multipart(copy=False)
            if self.opener.open(head, mac, payloads) is None:
                raise RuntimeError("a reply failed its check (forged, replayed or out of order)")


def zmq_client(candidate: str, port: int, sent: dict[str, tuple[bytes, bytes]]) -> ZmqClient:
    if candidate in SEALED:
        return SealedClient(port, sent, SEALED[candidate])
    return ZmqClient(port, sent, curve=candidate == "zmq-curve")


def curve_client(sock, keys: tuple[bytes, bytes], server_public: bytes) -> None:  # noqa: ANN001
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.curve_serverkey = server_public


def handshake(port: int, keys: tuple[bytes, bytes], request: bytes,
              timeout: float) -> tuple[str | None, bytes | None]:
    """A CURVE client with ``keys`` (z85 public, secret) sends one small request to a
    ``zmq-curve`` server: the handshake's outcome (``succeeded``, ``failed-auth``, ...;
    None if none came in ``timeout`` s) and the reply (None if none came in ``timeout`` s
    of the outcome). Every socket and the context are closed before it returns."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    outcomes = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
                zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed-auth",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed-protocol",
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed"}
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(sum(outcomes))
    outcome = reply = None
    try:
        curve_client(sock, keys, curve_keys(SECRET, "server")[0])
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([bytes((CODE["small"], 0)), request])
        if monitor.poll(timeout * 1e3):
            outcome = outcomes[recv_monitor_message(monitor)["event"]]
        if sock.poll(timeout * 1e3):
            reply = sock.recv_multipart()[-1]
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        context.term()
    return outcome, reply
