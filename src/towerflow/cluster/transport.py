"""gRPC transport of the cluster: authenticated channels, raw-bytes calls, error mapping.

Every message is ``bytes``: no (de)serialisers are registered, so what a
service puts on the wire (protobuf headers with raw tensor buffers, as the
ps service does; ``safetensors`` bytes; JSON) is the service's own business
and nothing is ever unpickled.

Authentication (:mod:`towerflow.cluster.auth`, ``docs/security.md``): with a
per-cluster secret every call carries a token bound to the server's task and
incarnation, the method and the call's first request message, usable once;
the server refuses a call without a valid one before reading its body. TLS
(optionally mutual) encrypts and authenticates the connection itself.

Sizes (:mod:`towerflow.cluster.frames`): a server reads no gRPC message longer than a frame
(4 MiB) and a little, whoever sends it and whatever the method (the unauthenticated health
check included): gRPC refuses a longer one from its length prefix, before reading it. A
request message of up to ``max_message_bytes`` (64 MiB) travels in frames, joined by the
server before its handler sees it; replies are sent whole, up to ``max_message_bytes``.

Example:
    >>> creds = Credentials(secret=b"s3cret")
    >>> channel = make_channel("localhost:2222", creds)        # doctest: +SKIP
    >>> unary(channel, "/towerflow.cluster.Control/Ping", b"", timeout=5.0)  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import queue
import secrets
import stat
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from towerflow.cluster.auth import AUTH_METADATA_KEY, RESTARTED, AuthInterceptor, ClientAuth
from towerflow.cluster.frames import DEFAULT_FRAME_BYTES, frame_metadata, framed, pieces
from towerflow.cluster.options import DEFAULT_MAX_MESSAGE_BYTES, ChannelOptions
from towerflow.cluster.spec import parse_address, strip_scheme
from towerflow.errors import (
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    TowerflowError,
    from_grpc_code,
)

__all__ = [
    "AUTH_METADATA_KEY",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_FRAME_BYTES",
    "Credentials",
    "TLSConfig",
    "AuthInterceptor",
    "ChannelOptions",
    "make_channel",
    "channel_address",
    "unary",
    "stream_unary",
    "unary_stream",
    "raw_handlers",
    "requests_until_closed",
    "RequestStream",
    "map_rpc_error",
    "server_credentials",
    "new_secret",
    "read_secret_file",
    "write_secret_file",
]

logger = logging.getLogger("towerflow.cluster")

_RPC_KINDS = ("unary_unary", "stream_unary", "unary_stream", "stream_stream")


# --------------------------------------------------------------------------- credentials
@dataclass(frozen=True, slots=True)
class TLSConfig:
    """PEM files for TLS.

    Attributes:
        cert: this end's certificate chain (required on a server; on a client it
            makes the connection mutual).
        key: the private key of ``cert``.
        ca: the CA bundle that signed the peers' certificates. On a server a CA
            turns on mutual TLS (clients must present a certificate it signed);
            on a client it is the root used to verify the server.
        server_name: the name to check the server certificate against when it
            differs from the host in the address (``grpc.ssl_target_name_override``).
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    server_name: str | None = None

    def _read(self, path: Path | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(
                f"TLS {what} file '{path}' does not exist; pass the path of a PEM file."
            ) from None


@dataclass(frozen=True, slots=True)
class Credentials:
    """How the tasks of a cluster prove who they are.

    Attributes:
        secret: the per-cluster secret; every call is authenticated with it.
        tls: certificates for TLS / mutual TLS.
        insecure: allow a server without secret and TLS on a non-loopback address.
    """

    secret: bytes | None = None
    tls: TLSConfig | None = None
    insecure: bool = False

    def __repr__(self) -> str:  # never print the secret
        secret = "<set>" if self.secret else None
        return f"Credentials(secret={secret}, tls={self.tls!r}, insecure={self.insecure})"

    @property
    def authenticated(self) -> bool:
        """Whether calls are authenticated (a secret or mutual TLS)."""
        return bool(self.secret) or (self.tls is not None and self.tls.ca is not None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """Read ``TOWERFLOW_SECRET`` or ``TOWERFLOW_SECRET_FILE`` and ``TOWERFLOW_TLS_CERT``,
        ``TOWERFLOW_TLS_KEY``, ``TOWERFLOW_TLS_CA``, ``TOWERFLOW_TLS_SERVER_NAME``, and
        ``TOWERFLOW_INSECURE`` (``1``: serve off loopback without secret or TLS).

        ``TOWERFLOW_SECRET`` wins over ``TOWERFLOW_SECRET_FILE`` when both are set.

        Raises:
            InvalidArgumentError: ``TOWERFLOW_INSECURE`` is neither ``0`` nor ``1``.
        """
        env = os.environ if env is None else env
        secret: bytes | None = None
        if env.get("TOWERFLOW_SECRET"):
            secret = env["TOWERFLOW_SECRET"].encode()
        elif env.get("TOWERFLOW_SECRET_FILE"):
            secret = read_secret_file(env["TOWERFLOW_SECRET_FILE"])
        paths = {k: env.get(f"TOWERFLOW_TLS_{k.upper()}") for k in ("cert", "key", "ca")}
        tls = None
        if any(paths.values()):
            tls = TLSConfig(
                **{k: Path(v) if v else None for k, v in paths.items()},
                server_name=env.get("TOWERFLOW_TLS_SERVER_NAME") or None,
            )
        insecure = env.get("TOWERFLOW_INSECURE", "0")
        if insecure not in ("0", "1"):
            raise InvalidArgumentError(
                f"TOWERFLOW_INSECURE={insecure!r} is not 0 or 1; set 1 only to serve off loopback "
                "without a secret or TLS on a network you trust."
            )
        return cls(secret=secret, tls=tls, insecure=insecure == "1")


def new_secret() -> bytes:
    """A fresh random cluster secret (64 hex characters)."""
    return secrets.token_hex(32).encode()


def write_secret_file(path: str | Path, secret: bytes) -> Path:
    """Write ``secret`` to a new file readable by its owner only (mode 0600)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return path


def read_secret_file(path: str | Path) -> bytes:
    """Read a cluster secret from a file, warning when others can read it.

    Raises:
        NotFoundError: the file does not exist.
        InvalidArgumentError: the file is empty.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes().strip()
    except FileNotFoundError:
        raise NotFoundError(
            f"secret file '{path}' does not exist; create it (mode 0600) or unset "
            "TOWERFLOW_SECRET_FILE."
        ) from None
    if not data:
        raise InvalidArgumentError(f"secret file '{path}' is empty; write a random secret into it.")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("secret file %s is readable by other users; chmod 600 it", path)
    return data


# --------------------------------------------------------------------------- channels
_ADDRESSES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_FRAMES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def make_channel(
    address: str,
    credentials: Credentials,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: ChannelOptions | None = None,
) -> grpc.Channel:
    """Open a channel to ``address`` (``host:port`` or ``grpc://host:port``).

    Every call made through the channel carries ``credentials``: an auth token
    when there is a secret, TLS (with this end's certificate for mutual TLS)
    when there is a :class:`TLSConfig`.
    """
    target = strip_scheme(address)
    parse_address(target, owner=" of the peer")
    if options is None:
        options = ChannelOptions(max_message_bytes=max_message_bytes)
    grpc_options = options.grpc_options()
    tls = credentials.tls
    if tls is not None:
        if tls.server_name:
            grpc_options.append(("grpc.ssl_target_name_override", tls.server_name))
        channel_creds = grpc.ssl_channel_credentials(
            root_certificates=tls._read(tls.ca, "CA"),
            private_key=tls._read(tls.key, "key"),
            certificate_chain=tls._read(tls.cert, "certificate"),
        )
        channel = grpc.secure_channel(target, channel_creds, options=grpc_options)
    else:
        channel = grpc.insecure_channel(target, options=grpc_options)
    if credentials.secret:
        channel = grpc.intercept_channel(channel, ClientAuth(credentials.secret, channel, target))
    _ADDRESSES[channel] = target
    _FRAMES[channel] = options.frame_bytes
    return channel


def channel_address(channel: grpc.Channel) -> str:
    """The address a channel from :func:`make_channel` talks to (``"?"`` if unknown)."""
    return _ADDRESSES.get(channel, "?")


def channel_frame_bytes(channel: grpc.Channel) -> int:
    """The frame size of a channel from :func:`make_channel` (the default for another)."""
    return _FRAMES.get(channel, DEFAULT_FRAME_BYTES)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server TLS credentials; a CA in ``tls`` requires client certificates (mutual TLS)."""
    if tls.cert is None or tls.key is None:
        raise InvalidArgumentError(
            f"a TLS server needs both a certificate and a key, got cert={tls.cert} "
            f"key={tls.key}; set TOWERFLOW_TLS_CERT and TOWERFLOW_TLS_KEY."
        )
    pair = (tls._read(tls.key, "key"), tls._read(tls.cert, "certificate"))
    ca = tls._read(tls.ca, "CA")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


# --------------------------------------------------------------------------- calls
def map_rpc_error(error: grpc.RpcError, method: str, address: str = "?") -> TowerflowError:
    """The towerflow error for a failed call (``UNAVAILABLE`` -> ``UnavailableError`` ...)."""
    code = error.code() if hasattr(error, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else str(error)
    cls = from_grpc_code(name)
    hint = _hint(name, details or "")
    return cls(f"call {method} to {address} failed with {name}: {details}{hint}")


_HINTS = {
    "UNAVAILABLE": "; check that the task is running and reachable at that address.",
    "UNAUTHENTICATED": "; give every task the same cluster secret (TOWERFLOW_SECRET_FILE) "
    "or certificates signed by the same CA.",
    "DEADLINE_EXCEEDED": "; raise the timeout or check whether the peer is stalled.",
    "RESOURCE_EXHAUSTED": "; stream large payloads in chunks or raise max_message_bytes.",
}


def _hint(code: str, details: str) -> str:
    """The way out to add to a failure whose message does not already give one."""
    if code == "RESOURCE_EXHAUSTED" and "raise the cap" in details:
        return ""  # a stream cap: the server's message names it and how to raise it
    if code == "UNAVAILABLE" and RESTARTED in details:
        return ""  # refused by a restarted task before it ran: the message says to retry
    return _HINTS.get(code, "")


def _check_timeout(timeout: float | None, method: str) -> float:
    if timeout is None or isinstance(timeout, bool) or not (0 < timeout < math.inf):
        raise InvalidArgumentError(
            f"call {method} needs a finite positive deadline, got timeout={timeout!r}; pass "
            "timeout=<seconds>."
        )
    return float(timeout)


def _restarted(exc: grpc.RpcError) -> bool:
    return exc.code() == grpc.StatusCode.UNAVAILABLE and RESTARTED in (exc.details() or "")


def unary(channel: grpc.Channel, method: str, payload: bytes, *, timeout: float) -> bytes:
    """One request, one reply; grpc failures raise the matching towerflow error.

    A ``payload`` longer than the channel's frame travels in frames (one call).
    """
    timeout = _check_timeout(timeout, method)
    frame = channel_frame_bytes(channel)
    try:
        if len(payload) <= frame:
            return channel.unary_unary(method)(payload, timeout=timeout)
        return _framed_unary(channel, method, payload, frame, timeout)
    except grpc.RpcError as exc:
        raise map_rpc_error(exc, method, channel_address(channel)) from None


def _framed_unary(channel: grpc.Channel, method: str, payload: bytes, frame: int,
                  timeout: float) -> bytes:
    call = channel.stream_unary(method)
    metadata = frame_metadata(frame, len(payload))
    try:
        return call(pieces(payload, frame), timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        if not _restarted(exc):
            raise
    # the task restarted since the handshake and did not run it: once more, as a unary call is
    return call(pieces(payload, frame), timeout=timeout, metadata=metadata)


def stream_unary(
    channel: grpc.Channel, method: str, chunks: Iterable[bytes | memoryview], *, timeout: float
) -> bytes:
    """Stream ``chunks`` (the pieces of a large payload), get one reply.

    A chunk longer than the channel's frame travels in frames.
    """
    timeout = _check_timeout(timeout, method)
    frame = channel_frame_bytes(channel)
    try:
        return channel.stream_unary(method)(framed(chunks, frame), timeout=timeout,
                                            metadata=frame_metadata(frame))
    except grpc.RpcError as exc:
        raise map_rpc_error(exc, method, channel_address(channel)) from None


def unary_stream(
    channel: grpc.Channel, method: str, payload: bytes, *, timeout: float
) -> Iterator[bytes]:
    """One request, a stream of replies; iterate it to receive them.

    A ``payload`` longer than the channel's frame travels in frames.
    """
    timeout = _check_timeout(timeout, method)
    address = channel_address(channel)
    frame = channel_frame_bytes(channel)
    if len(payload) <= frame:
        call = channel.unary_stream(method)(payload, timeout=timeout)
    else:
        call = channel.stream_stream(method)(pieces(payload, frame), timeout=timeout,
                                             metadata=frame_metadata(frame, len(payload)))

    def replies() -> Iterator[bytes]:
        try:
            yield from call
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, method, address) from None
        finally:
            call.cancel()

    return replies()


# --------------------------------------------------------------------------- handlers
Handler = Callable[..., Any]


class RequestStream:
    """One open long-lived bidirectional call: requests queued, one reply per request, in order.

    Per-step traffic (the dense push stream, the tables' row stream) travels
    on such a call instead of a unary call per request: a call set up,
    authenticated and torn down per step costs both ends far more CPU than
    the request itself. :meth:`send` does not wait (gRPC's own thread of the
    call writes the queue), so requests to several peers are on their way
    before the first reply is read. The call's token is bound to the
    ``first`` request, queued before the call starts; later ones are covered
    by the connection (TLS off loopback). The call's deadline is ``timeout``
    plus a reuse window; a stream takes new requests only while a whole
    ``timeout`` of it is left (:attr:`fresh`), then is replaced, so no request
    is cut short by the stream's age. A failed request ends the call with its
    status, as it ends a unary call; the caller opens another stream. A
    request longer than the channel's frame travels in frames.

    Args:
        channel: an authenticated channel to the peer.
        method: the stream method's full path.
        timeout: the longest one request may take (seconds).
        first: the first request.
    """

    __slots__ = ("_call", "_requests", "_replies", "_usable_until", "_address", "_method",
                 "_frame", "outstanding")

    def __init__(self, channel: grpc.Channel, method: str, timeout: float, first: bytes) -> None:
        window = timeout / 4
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._frame = channel_frame_bytes(channel)
        self._put(first)
        self._address, self._method = channel_address(channel), method
        self._call = channel.stream_stream(method)(iter(self._requests.get, None),
                                                   timeout=timeout + window,
                                                   metadata=frame_metadata(self._frame))
        self._replies = iter(self._call)
        self._usable_until = time.monotonic() + window
        #: requests sent whose reply has not been read
        self.outstanding = 1

    @property
    def fresh(self) -> bool:
        """Whether a request sent now has a whole timeout of the call left."""
        return time.monotonic() < self._usable_until

    @property
    def idle(self) -> bool:
        """Whether every reply has been read (the stream may take a new round)."""
        return self.outstanding == 0

    def send(self, request: bytes) -> None:
        """Queue ``request``; its reply comes after those of the requests sent before it."""
        self.outstanding += 1
        self._put(request)

    def _put(self, request: bytes) -> None:
        if len(request) < self._frame:
            self._requests.put(request)
        else:
            for piece in pieces(request, self._frame):
                self._requests.put(piece)

    def receive(self) -> bytes:
        """The next reply's bytes.

        Raises:
            TowerflowError: the call ended (its status mapped, e.g.
                ``InvalidArgumentError`` for a refused request, ``UnavailableError``).
            DataLossError: the peer ended the call without an error and without
                the reply.
        """
        try:
            reply = next(self._replies, None)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self._method, self._address) from None
        if reply is None:
            raise DataLossError(
                f"the task at {self._address} ended its {self._method} stream without "
                "replying; the request is sent again on a new stream."
            )
        self.outstanding -= 1
        return reply

    def close(self) -> None:
        """End the call (gRPC's request thread ends with the request queue)."""
        self._requests.put(None)
        self._call.cancel()


def requests_until_closed(requests: Iterator[bytes]) -> Iterator[bytes]:
    """The requests of a long-lived stream, until its caller closes or drops it.

    A handler that answers each request of a stream in turn iterates this and
    yields one reply per request; a failure it raises ends the call with its
    status, as it ends a unary call.
    """
    while True:
        try:
            request = next(requests)
        except (StopIteration, grpc.RpcError):  # the caller closed or dropped the stream
            return
        yield request


def raw_handlers(service: str, methods: Mapping[str, tuple[str, Handler]]) -> grpc.GenericRpcHandler:
    """A bytes-in, bytes-out gRPC service.

    Args:
        service: full service name, e.g. ``"towerflow.ps.PS"``.
        methods: ``{name: (kind, fn)}`` with ``kind`` one of ``unary_unary``,
            ``stream_unary``, ``unary_stream``, ``stream_stream``. ``fn(request)``
            or ``fn(request, context)`` (when it takes two parameters) receives
            ``bytes`` (an iterator of ``bytes`` for streaming requests) and
            returns ``bytes`` (an iterator for streaming replies).

    A :class:`~towerflow.errors.TowerflowError` raised by ``fn`` becomes its
    gRPC status with the message; any other exception becomes ``INTERNAL``.
    """
    table = {}
    for name, (kind, fn) in methods.items():
        if kind not in _RPC_KINDS:
            raise InvalidArgumentError(
                f"method {service}/{name} has kind {kind!r}; use one of {list(_RPC_KINDS)}."
            )
        wrapped = _wrap(f"/{service}/{name}", fn, streaming_reply=kind.endswith("_stream"))
        table[name] = getattr(grpc, f"{kind}_rpc_method_handler")(wrapped)
    return grpc.method_handlers_generic_handler(service, table)


def _takes_context(fn: Handler) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _abort(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    if context.code() is not None:  # the handler aborted the call itself
        raise exc
    if isinstance(exc, grpc.RpcError):  # from its requests: the call ended under the handler
        # (cancelled, or gRPC refused a message longer than the server reads); gRPC knows
        logger.debug("%s ended while its handler read its requests: %s", method, exc)
        raise exc
    if isinstance(exc, TowerflowError):
        code = getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.UNKNOWN)
        context.abort(code, str(exc))
    logger.exception("handler of %s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {type(exc).__name__}: {exc}")


def _wrap(method: str, fn: Handler, *, streaming_reply: bool) -> Handler:
    with_context = _takes_context(fn)

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        return fn(request, context) if with_context else fn(request)

    if streaming_reply:

        def stream_handler(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            try:
                yield from call(request, context)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                _abort(context, method, exc)

        return stream_handler

    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return call(request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            _abort(context, method, exc)

    return handler

