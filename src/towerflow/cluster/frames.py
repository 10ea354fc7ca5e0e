"""Frames: a request larger than one gRPC message travels as several, so a server reads no
message bigger than a frame.

gRPC checks a message's length prefix against the server's receive limit
(``grpc.max_receive_message_length``) before it reads the body, but that limit is one number
for every method of the server: the unauthenticated health check included. So a task's server
receives messages of at most one frame (:data:`DEFAULT_FRAME_BYTES`, 4 MiB, and
:data:`FRAME_HEADROOM` for a caller whose chunk has a header): a longer one is refused
(``RESOURCE_EXHAUSTED``) before it is read, whoever sends it. The data plane keeps the size it
needs (``ChannelOptions.max_message_bytes``, 64 MiB): the transport
(:mod:`~towerflow.cluster.transport`) sends a larger request message in frames and the server's
:class:`FrameInterceptor` joins them before the handler sees the message.

The framing, on a call whose metadata carries ``x-towerflow-frames: <F>`` (``<F>:<N>`` for a
call of one request message of ``N`` bytes, refused at once when ``N`` is over the limit): a
piece of exactly ``F`` bytes continues into the next piece; a shorter one (possibly empty) ends
the message. A message shorter than a frame is therefore sent as it is, in one piece; one of
``k * F`` bytes ends with an empty piece. A call without the key is not framed.

Example:
    >>> [len(p) for p in pieces(bytes(10), 4)]
    [4, 4, 2]
    >>> [len(p) for p in pieces(bytes(8), 4)]
    [4, 4, 0]
    >>> list(join_pieces(iter([b"ab", b"ab", b"c", b"d"]), 2, 100))
    [b'ababc', b'd']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from towerflow.cluster.limits import handler_kind, make_handler
from towerflow.errors import InvalidArgumentError, ResourceExhaustedError

__all__ = [
    "FRAMES_METADATA_KEY",
    "DEFAULT_FRAME_BYTES",
    "FRAME_HEADROOM",
    "MIN_FRAME_BYTES",
    "CONTROL_CALLS",
    "FrameInterceptor",
    "frame_metadata",
    "frame_of",
    "pieces",
    "framed",
    "join_pieces",
]

FRAMES_METADATA_KEY = "x-towerflow-frames"
#: bytes of one frame (1-4 MiB chunks measured fastest for Python gRPC)
DEFAULT_FRAME_BYTES = 4 << 20
#: what a server reads past a frame in one message: the header of a caller's chunk
FRAME_HEADROOM = 64 << 10
#: the smallest frame a server accepts (smaller ones would cost a message per few bytes)
MIN_FRAME_BYTES = 64 << 10
#: the names of the control calls of towerflow's services (``<service>/<name>``): one small
#: message each, never framed, so a caller (the secret's holder too) can make the server read
#: no more than one frame for them
CONTROL_CALLS = frozenset({"Status", "Join", "Done", "Ledger", "Reserve", "Ping", "TableStatus",
                           "TableStats", "Check", "Watch", "Hello"})


def frame_metadata(frame: int, total: int | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata of a framed call (``total``: the one request message's bytes)."""
    return ((FRAMES_METADATA_KEY, str(frame) if total is None else f"{frame}:{total}"),)


def frame_of(metadata: Iterable[Any] | None) -> tuple[int, int | None] | None:
    """``(frame, total)`` of a call's metadata (``total`` None when not given), None when the
    call is not framed; ``(0, None)`` when the value is not two decimal numbers."""
    for key, value in metadata or ():
        if key == FRAMES_METADATA_KEY:
            frame, _, total = str(value).partition(":")
            if not (frame.isdigit() and len(frame) <= 12 and (not total or total.isdigit()
                                                              and len(total) <= 15)):
                return 0, None
            return int(frame), int(total) if total else None
    return None


def pieces(message: bytes | memoryview, frame: int) -> Iterator[bytes]:
    """``message`` as the pieces of a framed call: itself when shorter than ``frame``."""
    if len(message) < frame:
        yield message if isinstance(message, bytes) else bytes(message)
        return
    view = memoryview(message)
    for start in range(0, len(view), frame):
        yield bytes(view[start:start + frame])
    if len(view) % frame == 0:
        yield b""  # a full last piece would continue: an empty one ends the message


def framed(messages: Iterable[bytes | memoryview], frame: int) -> Iterator[bytes]:
    """The pieces of every message of ``messages``, in order."""
    for message in messages:
        yield from pieces(message, frame)


def join_pieces(requests: Iterator[bytes], frame: int, limit: int,
                too_long: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """The messages whose pieces ``requests`` yields (see the module docstring).

    Args:
        requests: the pieces, as a framed call receives them.
        frame: the call's frame size.
        limit: the most bytes one message may have.
        too_long: called with the bytes so far when a message passes ``limit``; it must
            raise (default: :class:`ResourceExhaustedError`).

    Raises:
        ResourceExhaustedError: a message longer than ``limit`` (before its next piece is
            kept).
        InvalidArgumentError: the pieces end inside a message.
    """
    parts: list[bytes] = []
    size = 0
    for piece in requests:
        size += len(piece)
        if size > limit:
            if too_long is not None:
                too_long(size)
            raise ResourceExhaustedError(
                f"a request message of more than {limit:,} bytes ({size:,} so far); send fewer "
                "bytes per call, or raise the cap (ChannelOptions.max_message_bytes) on both ends."
            )
        if len(piece) == frame:
            parts.append(piece)
            continue
        if parts:
            parts.append(piece)
            yield b"".join(parts)
            parts = []
        else:
            yield piece
        size = 0
    if parts:
        raise InvalidArgumentError(
            f"the request stream ended inside a framed message ({size:,} bytes in pieces of "
            f"{frame:,}); end every message with a piece shorter than the frame."
        )


def frame_limit_text() -> str:
    """The most bytes a server reads in one message, as a message says it."""
    return f"{DEFAULT_FRAME_BYTES + FRAME_HEADROOM:,} bytes"


class FrameInterceptor(grpc.ServerInterceptor):
    """Joins the pieces of a framed call before its handler sees them.

    A call without ``x-towerflow-frames`` is passed on untouched; a framed call to a control
    call (:data:`CONTROL_CALLS`) is refused unread. A framed one is read as a
    request stream (a unary method's one request included), each message joined from its
    pieces: at most ``max_message_bytes`` per message, refused with ``RESOURCE_EXHAUSTED``
    when it declares more (before anything is read) or when its pieces pass it (before the
    next is kept).

    Args:
        max_message_bytes: the most bytes one joined request message may have.
        owner: who refuses, for the message (e.g. ``/job:ps/replica:0/task:0``).
    """

    def __init__(self, max_message_bytes: int, owner: str = "this server") -> None:
        self.max_message_bytes = max_message_bytes
        self._owner = owner

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = continuation(handler_call_details)
        framing = frame_of(handler_call_details.invocation_metadata)
        if handler is None or framing is None:
            return handler
        frame, total = framing
        method = handler_call_details.method
        if method.rpartition("/")[2] in CONTROL_CALLS:
            return self._refusal(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{self._owner} refuses the framed call to {method}: a control call is one "
                f"message of at most a frame ({frame_limit_text()}); send fewer bytes, "
                "unframed."))
        if frame < MIN_FRAME_BYTES:
            return self._refusal(handler, grpc.StatusCode.INVALID_ARGUMENT, (
                f"{self._owner} refuses the framed call to {method}: {FRAMES_METADATA_KEY} "
                f"says a frame of {frame:,} bytes; send frames of at least "
                f"{MIN_FRAME_BYTES:,} bytes (a decimal number, or <frame>:<total>)."))
        if total is not None and total > self.max_message_bytes:
            return self._refusal(handler, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 self._too_long(method, total))
        return self._joining(handler, method, frame)

    def _too_long(self, method: str, size: int, *, so_far: bool = False) -> str:
        what = f"at least {size:,} bytes" if so_far else f"{size:,} bytes"
        return (f"{self._owner} refuses a request message of {what} to {method}: more "
                f"than its limit of {self.max_message_bytes:,} (max_message_bytes); send fewer "
                "bytes per call, or raise the cap (ChannelOptions.max_message_bytes of the "
                "server) on both ends.")

    @staticmethod
    def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                 message: str) -> grpc.RpcMethodHandler:
        """A handler that ends the call with ``code`` without reading its request."""

        def abort(requests: Any, context: grpc.ServicerContext) -> Any:
            context.abort(code, message)

        return make_handler(True, bool(handler.response_streaming), abort)

    def _joining(self, handler: grpc.RpcMethodHandler, method: str,
                 frame: int) -> grpc.RpcMethodHandler:
        real = getattr(handler, handler_kind(handler))
        parse = handler.request_deserializer or (lambda message: message)
        limit = self.max_message_bytes

        def messages(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            def too_long(size: int) -> None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              self._too_long(method, size, so_far=True))

            try:
                for message in join_pieces(requests, frame, limit, too_long):
                    yield parse(message)
            except InvalidArgumentError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {exc}")

        if handler.request_streaming:

            def streamed(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
                return real(messages(requests, context), context)

            behavior: Callable[..., Any] = streamed
        else:

            def one(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
                joined = messages(requests, context)
                request = next(joined, None)
                if request is None or next(joined, None) is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"a framed call to {method} must carry exactly one request "
                                  "message; send one.")
                return real(request, context)

            behavior = one
        return make_handler(True, bool(handler.response_streaming), behavior,
                            response_serializer=handler.response_serializer)
