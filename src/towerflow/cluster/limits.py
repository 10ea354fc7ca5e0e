"""What bounds a server's threads and its log: stream caps, rate-limited warnings, default-visible lines.

- :class:`StreamLimiter` — a server interceptor capping the streaming calls
  open at once, per peer (one gRPC connection) and in all, so that idle or
  stalled streams cannot take every handler thread. A stream past a cap is
  refused at once with ``RESOURCE_EXHAUSTED`` and a message naming the cap and
  how to raise it.
- :class:`RateLimitedLog` — a warning repeated many times is written once,
  then once more at the end of its window with the count
  (``... (and 2,999 more in the last 10 s)``).
- :func:`log_by_default` — an ``INFO`` line that is shown on stderr when the
  application configured no logging (as TensorFlow prints its peer-wait line),
  and follows the application's logging configuration when it has one.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import grpc

__all__ = [
    "StreamLimiter",
    "RateLimitedLog",
    "log_by_default",
    "handler_kind",
    "make_handler",
]

logger = logging.getLogger("towerflow.cluster")


# --------------------------------------------------------------------------- handlers
def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    """``unary_unary``, ``unary_stream``, ``stream_unary`` or ``stream_stream``."""
    return (f"{'stream' if handler.request_streaming else 'unary'}_"
            f"{'stream' if handler.response_streaming else 'unary'}")  # fmt: skip


def make_handler(request_streaming: bool, response_streaming: bool, behavior: Callable[..., Any],
                 response_serializer: Callable[[Any], bytes] | None = None
                 ) -> grpc.RpcMethodHandler:  # fmt: skip
    """A method handler of the given kind that passes raw request bytes to ``behavior``."""
    kind = (f"{'stream' if request_streaming else 'unary'}_"
            f"{'stream' if response_streaming else 'unary'}")  # fmt: skip
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(behavior, response_serializer=response_serializer)


# --------------------------------------------------------------------------- stream caps
class StreamLimiter(grpc.ServerInterceptor):
    """Refuse a streaming call past ``max_per_peer`` open on its connection or ``max_total`` in all.

    Args:
        max_total: most streaming calls open at once on this server.
        max_per_peer: most open at once from one peer (gRPC's peer address:
            one connection).
        owner: who refuses, for the message (e.g. ``/job:ps/replica:0/task:0``).
    """

    def __init__(self, max_total: int, max_per_peer: int, owner: str = "this server") -> None:
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self._owner = owner
        self._open: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()

    @property
    def open_streams(self) -> int:
        """Streaming calls open now."""
        return self._total

    def acquire(self, peer: str) -> str | None:
        """Take a slot for ``peer``; the refusal message when a cap is reached."""
        with self._lock:
            mine = self._open.get(peer, 0)
            if mine >= self.max_per_peer:
                return (f"{self._owner} refuses another stream from {peer}: it already has "
                        f"{mine} open, the cap per peer (max_streams_per_peer="
                        f"{self.max_per_peer}); close idle streams or raise the cap "
                        "(ServerOptions.max_streams_per_peer, towerflow server "
                        "--max-streams-per-peer).")  # fmt: skip
            if self._total >= self.max_total:
                return (f"{self._owner} refuses another stream from {peer}: {self._total} are "
                        f"open, the cap in all (max_streams={self.max_total}); close idle streams "
                        "or raise the cap (ServerOptions.max_streams with max_workers above it, "
                        "towerflow server --max-streams).")  # fmt: skip
            self._open[peer] = mine + 1
            self._total += 1
        return None

    def release(self, peer: str) -> None:
        """Give back a slot taken by :meth:`acquire`."""
        with self._lock:
            left = self._open.get(peer, 0) - 1
            if left > 0:
                self._open[peer] = left
            else:
                self._open.pop(peer, None)
            self._total -= 1

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        real = getattr(handler, handler_kind(handler))

        def limited(request: Any, context: grpc.ServicerContext) -> Any:
            peer = context.peer()
            refusal = self.acquire(peer)
            if refusal is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            if not context.add_callback(lambda: self.release(peer)):
                self.release(peer)  # the call already ended
            return real(request, context)

        factory = getattr(grpc, f"{handler_kind(handler)}_rpc_method_handler")
        return factory(limited, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


# --------------------------------------------------------------------------- logging
class RateLimitedLog:
    """Warnings of one kind at most once per ``interval``, then their count.

    The first warning of a kind is written at once; the ones that follow within
    ``interval`` seconds are counted, and when the window ends one line repeats
    the first with ``(and N more in the last 10 s)``.

    Args:
        log: the logger to write to.
        interval: the window, in seconds.
    """

    def __init__(self, log: logging.Logger | None = None, interval: float = 10.0) -> None:
        self._log = log or logger
        self.interval = interval
        self._windows: dict[str, list[Any]] = {}  # kind -> [message, args, suppressed, timer]
        self._lock = threading.Lock()
        self._closed = False  # after close(): every warning written at once, no timer

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        """Warn ``msg % args`` unless ``kind`` was warned within the window (then count it)."""
        with self._lock:
            window = self._windows.get(kind)
            if window is not None:
                window[2] += 1
                return
            if self._closed:
                self._log.warning(msg, *args)
                return
            timer = threading.Timer(self.interval, self._close, (kind,))
            timer.daemon = True
            self._windows[kind] = [msg, args, 0, timer]
            timer.start()
        self._log.warning(msg, *args)

    def _close(self, kind: str) -> None:
        with self._lock:
            window = self._windows.pop(kind, None)
        if window is not None and window[2]:
            msg, args, suppressed, _ = window
            self._log.warning(f"{msg} (and {suppressed:,} more in the last {self.interval:g} s)",
                              *args)

    def close(self) -> None:
        """End every open window now: its count is written and its timer thread ends (the
        server that owns this log calls it when it stops)."""
        with self._lock:
            self._closed = True
            kinds = list(self._windows)
        for kind in kinds:
            window = self._windows.get(kind)
            if window is not None:
                window[3].cancel()
                if window[3] is not threading.current_thread():
                    window[3].join(timeout=5.0)  # a timer that fired has written its line
            self._close(kind)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (as ``logging.lastResort`` does)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_DEFAULT_HANDLER = _StderrHandler()


def _logging_configured(log: logging.Logger) -> bool:
    """Whether the application set a level or a handler anywhere from ``log`` up to the root."""
    node: logging.Logger | None = log
    while node is not None:
        if node.handlers or (node.level != logging.NOTSET and node is not logging.root):
            return True
        node = node.parent if node.propagate else None
    return logging.root.level != logging.WARNING


def log_by_default(log: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """``log.log(level, msg, *args)``, shown on stderr when the application configured no logging.

    With no handler and no level set anywhere (a program that never touched
    ``logging``) the line goes to stderr as TensorFlow prints it; any logging
    configuration (``basicConfig``, a handler, a level on ``towerflow.cluster``)
    takes over and decides, as for every other line.
    """
    if log.isEnabledFor(level):
        log.log(level, msg, *args)
    elif not _logging_configured(log) and logging.root.manager.disable < level:
        _DEFAULT_HANDLER.handle(log.makeRecord(log.name, level, "(towerflow)", 0, msg, args, None))
