"""Call authentication: tokens bound to one server incarnation, one method and one request.

With a per-cluster secret every call carries the metadata
``x-towerflow-auth: v2:<incarnation>:<unix time>:<nonce>:<digest>:<mac>`` with::

    mac = HMAC-SHA256(secret, "v2\\n<task>\\n<incarnation>\\n<method>\\n<time>\\n<nonce>\\n<digest>")

- ``task`` and ``incarnation`` name the server the token is for: its task
  (``/job:ps/replica:0/task:0``) and a random 128-bit id it draws when it
  starts. A client learns both once per channel with an authenticated
  handshake (``Hello``: the server proves it holds the secret by a MAC over the
  client's random challenge; the client first proves it holds the secret by a
  fresh MAC over the same challenge, so the server tells its task and
  incarnation to no one else). A client with a secret refuses a server that
  cannot prove it holds the same one (``UnauthenticatedError``), also one
  that answers the handshake ``UNIMPLEMENTED`` (a server without a secret):
  calls are never sent to a peer that did not prove it belongs to the
  cluster. A token is therefore useless against any other
  task, and against the same task after a restart (a new incarnation), although
  a restarted server remembers no nonces.
- ``digest`` is the SHA-256 of the call's first request message: the whole
  body of a unary call, the first message (the header) of a streamed one; of
  a framed call (:mod:`~towerflow.cluster.frames`), the first message's
  pieces together. The server checks it against the bytes it receives before
  the handler sees them.
- ``time`` must be within ``freshness`` seconds of the server's clock and
  ``nonce`` must be new within this incarnation: a token works once.

The token is checked when the call's headers arrive, before its body is read:
a call without a valid token is refused without reading its request (the
refusal handler never asks for a message, so gRPC buffers at most one flow
control window of it). A token minted for an earlier incarnation of the task
is refused with ``UNAVAILABLE`` ("restarted"), as a call to a task that went
away; the client re-runs the handshake and its retry goes to the new
incarnation.

The standard health check (``/grpc.health.v1.Health/Check``, see
:mod:`~towerflow.cluster.health`, which bounds it) is the one exception: it
needs no token, so that Kubernetes probes work, and it tells nothing but
``SERVING`` or ``NOT_SERVING``.

Messages of a stream after its first are covered by the connection: TLS, which
a server on a non-loopback address requires by default (see ``docs/security.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from towerflow.cluster.frames import frame_of
from towerflow.cluster.health import UNAUTHENTICATED_METHODS
from towerflow.cluster.limits import RateLimitedLog, handler_kind, make_handler
from towerflow.cluster.options import DEFAULT_MAX_MESSAGE_BYTES
from towerflow.errors import InvalidArgumentError, UnauthenticatedError

__all__ = [
    "AUTH_METADATA_KEY",
    "CHALLENGE_METADATA_KEY",
    "HELLO_PROOF_METADATA_KEY",
    "HELLO_METHOD",
    "RESTARTED",
    "ServerIdentity",
    "AuthInterceptor",
    "ClientAuth",
    "make_token",
]

AUTH_METADATA_KEY = "x-towerflow-auth"
CHALLENGE_METADATA_KEY = "x-towerflow-challenge"
HELLO_PROOF_METADATA_KEY = "x-towerflow-hello"
HELLO_METHOD = "/towerflow.cluster.Auth/Hello"
RESTARTED = "restarted since the call was signed"
_VERSION = "v2"
_MAX_SEEN_NONCES = 100_000  # about 28 MB


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """The server a token is for: its task name and the random id of its current run."""

    task: str
    incarnation: str


def _mac(secret: bytes, *fields: str) -> str:
    return hmac.new(secret, "\n".join(fields).encode(), hashlib.sha256).hexdigest()


def _message_bytes(message: Any) -> bytes | memoryview:
    if isinstance(message, bytes | bytearray | memoryview):
        return message
    serialize = getattr(message, "SerializeToString", None)
    if serialize is None:
        raise InvalidArgumentError(
            f"cannot authenticate a request of type {type(message).__name__}; send bytes or a "
            "protobuf message."
        )
    return serialize()


def body_digest(message: Any) -> str:
    """SHA-256 (hex) of a request message as it goes on the wire (a list: the pieces of one
    framed message, in order)."""
    if isinstance(message, list):
        digest = hashlib.sha256()
        for piece in message:
            digest.update(_message_bytes(piece))
        return digest.hexdigest()
    return hashlib.sha256(_message_bytes(message)).hexdigest()


def _frame(metadata: Any) -> int | None:
    """The frame size of a framed call (None: not framed, or not a valid frame)."""
    framing = frame_of(metadata)
    return framing[0] if framing is not None and framing[0] > 0 else None


def make_token(
    secret: bytes, method: str, server: ServerIdentity, first_message: Any = b"",
    *, now: float | None = None,
) -> str:  # fmt: skip
    """A fresh token for one call of ``method`` to ``server`` whose first message is given."""
    stamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(12)
    digest = body_digest(first_message)
    mac = _mac(secret, _VERSION, server.task, server.incarnation, method, stamp, nonce, digest)
    return f"{_VERSION}:{server.incarnation}:{stamp}:{nonce}:{digest}:{mac}"


@dataclass(frozen=True, slots=True)
class _Verdict:
    reason: str | None
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
    digest: str = ""


def _is_hex(text: str, max_len: int) -> bool:
    return 0 < len(text) <= max_len and all(c in "0123456789abcdef" for c in text)


class AuthInterceptor(grpc.ServerInterceptor):
    """Server interceptor refusing every call without a valid token, before reading its body.

    Args:
        secret: the cluster secret.
        freshness: how far (seconds) a token's time may be from this clock.
        task: the task this server is (bound into every token).
        incarnation: this run's id (default: 128 random bits).
        log: where refusals are reported (rate-limited).
        max_message_bytes: the most bytes of a framed call's first message held while its
            digest is checked (more: ``RESOURCE_EXHAUSTED`` before the next piece is kept).
    """

    def __init__(self, secret: bytes, freshness: float = 300.0, *, task: str = "",
                 incarnation: str | None = None, log: RateLimitedLog | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._secret = secret
        self._max_message = max_message_bytes  # a framed first message held for its check
        self._freshness = freshness
        self.identity = ServerIdentity(task, incarnation or secrets.token_hex(16))
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._floor = -1  # tokens at or before this time were forgotten: refused as expired
        self._lock = threading.Lock()
        self._log = log or RateLimitedLog()

    def check(self, method: str, token: str | None, now: float | None = None) -> str | None:
        """``None`` when ``token`` is valid for ``method`` on this server, else the reason."""
        return self.verify(method, token, now).reason

    def verify(self, method: str, token: str | None, now: float | None = None) -> _Verdict:
        """Check a token (consuming its nonce when it is valid)."""
        if not token:
            return _Verdict("no credentials")
        parts = token.split(":")
        if (len(parts) != 6 or parts[0] != _VERSION or not parts[2].isdigit()
                or len(parts[2]) > 12 or not all(_is_hex(p, 64) for p in parts[3:])
                or not _is_hex(parts[1], 64)):  # fmt: skip
            return _Verdict("malformed credentials")
        _, incarnation, stamp, nonce, digest, mac = parts
        expected = _mac(self._secret, _VERSION, self.identity.task, incarnation, method, stamp,
                        nonce, digest)  # fmt: skip
        if not hmac.compare_digest(expected, mac):
            return _Verdict("wrong credentials (another secret, method or task)")
        now = time.time() if now is None else now
        if abs(now - int(stamp)) > self._freshness:
            return _Verdict("expired credentials (check the clocks)")
        if incarnation != self.identity.incarnation:
            return _Verdict(f"{self.identity.task or 'the server'} {RESTARTED} (token for "
                            f"incarnation {incarnation}, now {self.identity.incarnation}); the "
                            "call was not run, retry it", grpc.StatusCode.UNAVAILABLE)
        return self._consume(nonce, int(stamp), now, digest)

    def _consume(self, nonce: str, stamp: int, now: float, digest: str) -> _Verdict:
        """Remember ``nonce``; refuse it when it was seen (or may have been and was forgotten).

        A nonce is remembered until its token can no longer pass the time check
        (arrival + 2 x freshness), or, past ``_MAX_SEEN_NONCES`` remembered, until
        newer ones push it out: every token stamped at or before a forgotten one
        is then refused as expired, so memory stays bounded and no replay passes.
        """
        with self._lock:
            seen = self._seen
            while seen and next(iter(seen.values()))[0] < now - 2 * self._freshness:
                seen.popitem(last=False)
            while len(seen) >= _MAX_SEEN_NONCES:
                self._floor = max(self._floor, seen.popitem(last=False)[1][1])
            if stamp <= self._floor:
                return _Verdict("expired credentials (issued before the oldest remembered call)")
            if nonce in seen:
                return _Verdict("replayed credentials")
            seen[nonce] = (now, stamp)
        return _Verdict(None, digest=digest)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        method = handler_call_details.method
        if method == HELLO_METHOD:
            return make_handler(True, False, self._hello)
        if method in UNAUTHENTICATED_METHODS:  # the health probe: it says SERVING or not, only
            return continuation(handler_call_details)
        token = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                token = value
                break
        verdict = self.verify(method, token)
        handler = continuation(handler_call_details)
        if verdict.reason is None:
            frame = _frame(handler_call_details.invocation_metadata)
            return None if handler is None else _bound_to(handler, verdict.digest, method, frame,
                                                          self._max_message)
        self._log.warning(verdict.reason.split(" (")[0], "refused call to %s: %s", method,
                          verdict.reason)
        return _refusal(handler, verdict.code, f"call refused: {method}: {verdict.reason}")

    def _hello(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """The handshake: who this server is, proven by a MAC over the client's challenge.

        The client proves first (a fresh MAC over its challenge and time, used
        once): a caller without the secret learns neither the task nor its
        incarnation.
        """
        metadata = dict(context.invocation_metadata() or ())
        challenge = metadata.get(CHALLENGE_METADATA_KEY, "")
        if not _is_hex(challenge, 64) or len(challenge) < 32:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "handshake needs a challenge of 32-64 hex digits")
        reason = self._client_proof(challenge, str(metadata.get(HELLO_PROOF_METADATA_KEY, "")))
        if reason is not None:
            self._log.warning(reason, "refused handshake: %s", reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"handshake refused: {reason}")
        task, incarnation = self.identity.task, self.identity.incarnation
        proof = _mac(self._secret, "hello", challenge, task, incarnation)
        return json.dumps({"task": task, "incarnation": incarnation, "proof": proof}).encode()

    def _client_proof(self, challenge: str, said: str) -> str | None:
        """``None`` when ``said`` (``<time>:<mac>``) proves the secret for ``challenge``, once."""
        stamp, _, mac = said.partition(":")
        if not (stamp.isdigit() and len(stamp) <= 12 and _is_hex(mac, 64)):
            return "no credentials (the client did not prove that it holds the cluster secret)"
        if not hmac.compare_digest(_mac(self._secret, "hello-client", challenge, stamp), mac):
            return "wrong credentials (the client holds another cluster secret)"
        now = time.time()
        if abs(now - int(stamp)) > self._freshness:
            return "expired credentials (check the clocks)"
        return self._consume(challenge, int(stamp), now, "").reason


def _refusal(real: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
             message: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``code`` without asking for its request."""

    def abort(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    streaming_reply = bool(real is not None and real.response_streaming)
    return make_handler(True, streaming_reply, abort)


def _bound_to(handler: grpc.RpcMethodHandler, digest: str, method: str,
              frame: int | None = None, limit: int = DEFAULT_MAX_MESSAGE_BYTES
              ) -> grpc.RpcMethodHandler:
    """``handler``, run only once its first request message matches the token's digest
    (``frame``: of a framed call, whose first message is its first pieces up to a short one)."""
    kind = handler_kind(handler)
    real = getattr(handler, kind)
    parse = handler.request_deserializer or (lambda message: message)

    def check(message: Any, context: grpc.ServicerContext) -> None:
        if not hmac.compare_digest(body_digest(message), digest):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"call refused: {method}: the request is not the one its credentials "
                          "were issued for")  # fmt: skip

    def first_pieces(requests: Iterator[bytes], context: grpc.ServicerContext) -> list[bytes]:
        head: list[bytes] = []
        size = 0
        for piece in requests:
            size += len(piece)
            if size > limit:  # bounded as join_pieces bounds every later message
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"call refused: {method}: a request message of more than "
                              f"{limit:,} bytes")
            head.append(piece)
            if len(piece) != frame:
                break
        return head

    if not handler.request_streaming:

        def unary_request(request: bytes, context: grpc.ServicerContext) -> Any:
            check(request, context)
            return real(parse(request), context)

        behavior: Callable[..., Any] = unary_request
    else:

        def checked(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            if frame is not None:  # the first message's pieces, checked before any is passed on
                head = first_pieces(requests, context)
                check(head, context)
            else:
                first = next(requests, None)
                check(b"" if first is None else first, context)
                head = [] if first is None else [first]
            if head:
                for message in head:
                    yield parse(message)
                for message in requests:
                    yield parse(message)

        def streamed_request(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            return real(checked(requests, context), context)

        behavior = streamed_request
    return make_handler(bool(handler.request_streaming), bool(handler.response_streaming),
                        behavior, response_serializer=handler.response_serializer)


# --------------------------------------------------------------------------- client side
class ClientAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds a token to every outgoing call of one channel.

    The first call runs the handshake on ``raw`` (the channel without this
    interceptor) to learn which task and incarnation answer at the address; a
    refusal saying the task restarted forgets them, so the next call learns the
    new ones (a blocking unary call is retried once at once: it was not run).
    """

    def __init__(self, secret: bytes, raw: grpc.Channel, address: str = "?") -> None:
        self._secret = secret
        self._raw = raw
        self._address = address
        self._server: ServerIdentity | None = None
        self._lock = threading.Lock()

    @property
    def server(self) -> ServerIdentity | None:
        """The server identity learned by the handshake (None before the first call)."""
        return self._server

    def identity(self, timeout: float | None = None) -> ServerIdentity:
        """The task and incarnation answering at the address (a handshake when not known)."""
        server = self._server
        if server is not None:
            return server
        with self._lock:
            if self._server is None:
                self._server = self._hello(10.0 if timeout is None else min(timeout, 10.0))
            return self._server

    def _hello(self, timeout: float) -> ServerIdentity:
        challenge = secrets.token_hex(16)
        stamp = str(int(time.time()))
        proof = f"{stamp}:{_mac(self._secret, 'hello-client', challenge, stamp)}"
        try:
            reply = self._raw.unary_unary(HELLO_METHOD)(
                b"", timeout=timeout, metadata=((CHALLENGE_METADATA_KEY, challenge),
                                                (HELLO_PROOF_METADATA_KEY, proof)))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise UnauthenticatedError(
                    f"refusing the task at {self._address}: it answered the handshake with "
                    "UNIMPLEMENTED, so it holds no cluster secret and cannot prove that it "
                    "belongs to this cluster (nothing was sent to it); give every task the same "
                    "cluster secret (TOWERFLOW_SECRET_FILE), or check the address."
                ) from None
            raise
        try:
            said = json.loads(reply)
            task, incarnation = str(said["task"]), str(said["incarnation"])
            proof = str(said["proof"])
        except (ValueError, KeyError, TypeError):
            proof, task, incarnation = "", "", ""
        expected = _mac(self._secret, "hello", challenge, task, incarnation)
        if not hmac.compare_digest(expected.encode(), proof.encode("utf-8", "replace")):
            raise UnauthenticatedError(
                f"handshake with the task at {self._address} failed with UNAUTHENTICATED: wrong "
                "credentials: it did not prove that it holds this task's cluster secret; give "
                "every task the same cluster secret (TOWERFLOW_SECRET_FILE)."
            )
        return ServerIdentity(task, incarnation)

    def _details(self, details: grpc.ClientCallDetails, first: Any) -> grpc.ClientCallDetails:
        token = make_token(self._secret, details.method, self.identity(details.timeout), first)
        metadata = [*(details.metadata or ()), (AUTH_METADATA_KEY, token)]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )  # fmt: skip

    def _forget_if_restarted(self, call: Any) -> bool:
        try:
            restarted = (call.code() == grpc.StatusCode.UNAVAILABLE
                         and RESTARTED in (call.details() or ""))  # fmt: skip
        except Exception:  # noqa: BLE001 - a call object that cannot say: nothing learned
            return False
        if restarted:
            self._server = None
        return restarted

    def _watch(self, call: Any) -> Any:
        add = getattr(call, "add_done_callback", None)
        if add is not None:
            add(self._forget_if_restarted)
        return call

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        outcome = continuation(self._details(details, request), request)
        if outcome.done() and self._forget_if_restarted(outcome):
            outcome = continuation(self._details(details, request), request)
        return self._watch(outcome)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return self._watch(continuation(self._details(details, request), request))

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[override]
        first, requests = _peek(request_iterator, _frame(details.metadata))
        return self._watch(continuation(self._details(details, first), requests))

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[override]
        first, requests = _peek(request_iterator, _frame(details.metadata))
        return self._watch(continuation(self._details(details, first), requests))


def _peek(requests: Any, frame: int | None = None) -> tuple[Any, Iterator[Any]]:
    """The first message of a request stream (``b""`` when empty; of a framed call, the list
    of its pieces) and the whole stream."""
    iterator = iter(requests)
    if frame is None:
        for first in iterator:
            return first, itertools.chain((first,), iterator)
        return b"", iter(())
    head: list[Any] = []
    for piece in iterator:
        head.append(piece)
        if len(piece) != frame:
            break
    if not head:
        return b"", iter(())
    return head, itertools.chain(head, iterator)


class _CallDetails(grpc.ClientCallDetails):
    __slots__ = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")

    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):  # type: ignore[no-untyped-def]
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
