"""The tuning of a task's server and of the heartbeats it sends: plain, validated values.

:class:`ServerOptions` is what ``towerflow.Server(..., options=...)`` takes;
its ``heartbeat`` field is a :class:`HeartbeatOptions`, which the
:class:`~towerflow.cluster.heartbeat.HeartbeatMonitor` of a ps task follows.

Example:
    >>> ServerOptions(heartbeat=HeartbeatOptions(interval=0.5)).heartbeat.detection_bound
    2.0
"""

from __future__ import annotations

from dataclasses import dataclass, field

from towerflow.cluster.transport import ChannelOptions
from towerflow.errors import InvalidArgumentError

__all__ = ["HeartbeatOptions", "ServerOptions"]


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
