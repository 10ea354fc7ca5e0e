"""The tuning of a task's server, its channels and the heartbeats it sends: plain, validated values.

:class:`ServerOptions` is what ``towerflow.Server(..., options=...)`` takes;
its ``heartbeat`` field is a :class:`HeartbeatOptions`, which the
:class:`~towerflow.cluster.heartbeat.HeartbeatMonitor` of a ps task follows,
and its ``channel`` field a :class:`ChannelOptions` (gRPC sizes, windows and
keepalives, also what :func:`~towerflow.cluster.transport.make_channel` takes).

Example:
    >>> ServerOptions(heartbeat=HeartbeatOptions(interval=0.5)).heartbeat.detection_bound
    2.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from towerflow.cluster.frames import DEFAULT_FRAME_BYTES, FRAME_HEADROOM, MIN_FRAME_BYTES
from towerflow.errors import InvalidArgumentError

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "ChannelOptions", "HeartbeatOptions", "ServerOptions"]

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_STREAM_WINDOW_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class ChannelOptions:
    """gRPC options shared by channels and servers.

    Attributes:
        max_message_bytes: largest message sent or received (a request larger
            than a frame travels in frames); larger tensor payloads are streamed
            in chunks.
        frame_bytes: a channel sends a request message longer than this in
            frames of this size; a server reads no gRPC message longer than
            this plus 64 KiB (``grpc.max_receive_message_length``), so a longer
            one is refused before it is read, on every method: what a caller
            without credentials can make the server hold is bounded by it.
        keepalive_ms: interval of HTTP/2 keepalive pings, so a dead peer is noticed.
        keepalive_timeout_ms: how long a keepalive ping may go unanswered.
        max_reconnect_backoff_ms: longest pause between reconnection attempts to
            a peer that is down, so a restarted task is reached again quickly.
        stream_window_bytes: the HTTP/2 flow-control window of each call: how
            much a peer may send ahead of what this side has read. A fixed
            window bounds the memory a ps task spends on data in flight by the
            number of calls, not by what gRPC's bandwidth-delay probing grows
            it to (on loopback, 2 workers: ps peak memory 2.73-2.77x of the
            parameter bytes fixed vs 2.83-3.01x probing, for 5-10% less
            traffic). 2 MiB carries 10 GB/s at 0.2 ms round trip; ``None``
            lets gRPC size the window itself (long, fast links).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    keepalive_ms: int = 10_000
    keepalive_timeout_ms: int = 5_000
    max_reconnect_backoff_ms: int = 2_000
    stream_window_bytes: int | None = DEFAULT_STREAM_WINDOW_BYTES
    frame_bytes: int = DEFAULT_FRAME_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.frame_bytes, bool) or not isinstance(self.frame_bytes, int) \
                or self.frame_bytes < MIN_FRAME_BYTES:
            raise InvalidArgumentError(
                f"ChannelOptions(frame_bytes={self.frame_bytes!r}): a frame must be an integer "
                f"of at least {MIN_FRAME_BYTES:,} bytes; leave the default "
                f"({DEFAULT_FRAME_BYTES:,}) unless a measurement says otherwise."
            )

    @property
    def server_receive_bytes(self) -> int:
        """The longest gRPC message a server reads: a frame and its headroom, at most
        ``max_message_bytes``."""
        return min(self.max_message_bytes, self.frame_bytes + FRAME_HEADROOM)

    def _common(self, receive: int) -> list[tuple[str, Any]]:
        window = [] if self.stream_window_bytes is None else [
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", self.stream_window_bytes),
        ]
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", receive),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            *window,
        ]

    def grpc_options(self) -> list[tuple[str, Any]]:
        """The options as gRPC channel arguments."""
        return self._common(self.max_message_bytes) + [
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", self.keepalive_ms),
            ("grpc.initial_reconnect_backoff_ms", min(100, self.max_reconnect_backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, self.max_reconnect_backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", self.max_reconnect_backoff_ms),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        """The options as gRPC server arguments (a taken port is an error, not shared; no
        message longer than :attr:`server_receive_bytes` is read)."""
        return self._common(self.server_receive_bytes) + [
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.keepalive_ms // 2),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", 0),
        ]


@dataclass(frozen=True, slots=True)
class HeartbeatOptions:
    """How often peers are pinged and when they are declared dead.

    Attributes:
        interval: seconds between two beats to one peer.
        max_missed: beats missed in a row after which a peer is dead.
        timeout: deadline of one beat (default: ``interval``).
        startup_grace: seconds a peer that has never answered has to answer its
            first beat before it is declared dead (tasks start at different times).
    """

    interval: float = 1.0
    max_missed: int = 3
    timeout: float | None = None
    startup_grace: float = 30.0

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise InvalidArgumentError(
                f"heartbeat interval must be a positive number of seconds, got {self.interval!r}."
            )
        if isinstance(self.max_missed, bool) or not isinstance(self.max_missed, int) \
                or self.max_missed < 1:
            raise InvalidArgumentError(
                f"max_missed must be an integer >= 1, got {self.max_missed!r}."
            )
        if self.timeout is not None and not self.timeout > 0:
            raise InvalidArgumentError(
                f"heartbeat timeout must be a positive number of seconds, got {self.timeout!r}."
            )
        if not self.startup_grace >= 0:
            raise InvalidArgumentError(
                f"startup_grace must be >= 0 seconds, got {self.startup_grace!r}."
            )

    @property
    def beat_timeout(self) -> float:
        """The deadline of one beat."""
        return self.timeout if self.timeout is not None else self.interval

    @property
    def detection_bound(self) -> float:
        """Seconds within which a peer that stops answering is declared dead.

        The beat in flight when it stops, then ``max_missed`` missed beats, each
        at most ``max(interval, timeout)`` apart (plus scheduling delays).
        """
        return (self.max_missed + 1) * max(self.interval, self.beat_timeout)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Tuning of a :class:`Server`.

    Attributes:
        max_workers: most handler threads (created on demand). Blocking
            handlers each hold one while they run: a sync-mode ps waiting for
            gradients, and each worker's open push-and-pull stream to a ps
            (one per worker and ps task), so it bounds the workers a ps can
            serve at once.
        channel: message size and keepalive options of the server and of the
            channels it opens to peers.
        auth_freshness: how many seconds an auth token's time may differ from
            this machine's clock.
        heartbeat: how the hosted services watch their peers (a ps task
            watches the chief and the workers, and names a dead or suspended
            one); None: no heartbeats. ``towerflow server`` turns them on.
        bind_host: the interface to listen on instead of the host the
            cluster spec names, e.g. ``"0.0.0.0"`` or ``"::"`` for all (a
            container whose spec names a service address); None: the spec's
            host. The port is always the spec's.
        max_streams: most streaming calls open at once (each holds a handler
            thread); None: three quarters of ``max_workers``, so unary calls
            always find a thread. A stream past the cap is refused at once
            (``ResourceExhaustedError`` naming the cap).
        max_streams_per_peer: most streaming calls open at once on one
            connection (an honest worker keeps a few per ps task).
        warning_interval: a repeated warning (a refused call, ...) is written
            once per this many seconds, then with the count of the others.
        serve_forever: a ps task serves until it is stopped (a signal,
            :meth:`Server.stop`), as before it learned when its job ends.
            False (default): it ends by itself, and :meth:`Server.join`
            returns, once every training replica has said it finished (the
            chief after its final checkpoint).
        idle_timeout: seconds a ps task keeps its parameters while none of the
            replicas that have not finished is alive (they were killed, or
            are suspended), waiting for them to come back; then it ends and
            :meth:`Server.join` raises. None: wait forever. Unused with
            ``serve_forever``.
    """

    max_workers: int = 256
    channel: ChannelOptions = field(default_factory=ChannelOptions)
    auth_freshness: float = 300.0
    heartbeat: HeartbeatOptions | None = None
    bind_host: str | None = None
    max_streams: int | None = None
    max_streams_per_peer: int = 32
    warning_interval: float = 10.0
    serve_forever: bool = False
    idle_timeout: float | None = 3600.0

    def __post_init__(self) -> None:
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise InvalidArgumentError(
                f"ServerOptions(idle_timeout={self.idle_timeout!r}): give a positive number of "
                "seconds, or None to keep the parameters forever while the workers are gone."
            )

    def stream_cap(self) -> int:
        """``max_streams``, checked against ``max_workers``.

        Raises:
            InvalidArgumentError: a cap that is not positive, or not below ``max_workers``.
        """
        cap = self.max_streams if self.max_streams is not None else self.max_workers * 3 // 4
        if not 0 < cap < self.max_workers or self.max_streams_per_peer <= 0:
            raise InvalidArgumentError(
                f"ServerOptions(max_streams={self.max_streams}, max_streams_per_peer="
                f"{self.max_streams_per_peer}, max_workers={self.max_workers}): the stream caps "
                "must be positive and max_streams below max_workers, so that unary calls always "
                "find a thread; raise max_workers with max_streams."
            )
        return cap
