"""Heartbeats: which tasks of the cluster are alive, and which are dead or suspended.

A :class:`HeartbeatMonitor` runs next to a task's :class:`~towerflow.cluster.Server`
and pings its peers every ``interval`` seconds through the server's built-in,
authenticated ``Ping`` (so a heartbeat is an ordinary authenticated call with a
deadline, and the watched tasks need nothing but their ``Server``). A peer that
misses ``max_missed`` beats in a row is declared dead: a killed task refuses
the connection, a suspended one (``SIGSTOP``) or a hung one accepts it but
does not answer before the beat's deadline. Both are reported by name::

    task /job:worker/replica:0/task:1 at localhost:2223 missed 3 heartbeats (last seen 1.6 s
    ago; last beat: no reply before the deadline); it is dead or suspended

A peer that answers again is declared alive again; one that has never
answered is given ``startup_grace`` seconds to start before it can be
declared dead. Other code asks
:meth:`HeartbeatMonitor.dead` / :meth:`HeartbeatMonitor.health`, raises with
:meth:`HeartbeatMonitor.check`, or passes ``on_dead`` / ``on_alive`` callbacks
(run on the monitor's threads; keep them short).

Example:
    >>> server = Server(cluster, "ps", 0)                                  # doctest: +SKIP
    >>> with HeartbeatMonitor(server, jobs=["worker"],
    ...                       options=HeartbeatOptions(interval=0.5, max_missed=3)) as beats:
    ...     beats.dead()                                                   # doctest: +SKIP
    []
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from towerflow.cluster.options import HeartbeatOptions
from towerflow.cluster.server import Server
from towerflow.cluster.spec import TaskInfo
from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    TowerflowError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = ["HeartbeatOptions", "PeerHealth", "HeartbeatMonitor"]

logger = logging.getLogger("towerflow.cluster.heartbeat")

#: why a beat failed, by the error of the ping
_NO_CONNECTION = "failed to connect: the process is gone or not started"
_NO_REPLY = "no reply before the deadline: the process is suspended or hung"


@dataclass(frozen=True, slots=True)
class PeerHealth:
    """What the monitor knows about one peer (an immutable snapshot).

    Attributes:
        task: the peer.
        address: its ``host:port``.
        alive: False once it has missed ``max_missed`` beats in a row.
        missed: beats missed in a row.
        last_seen: ``time.monotonic()`` of its last answer (None: never answered).
        reason: why the last beat failed ("" after an answer).
        pid: the process id it reported in its last answer.
        since: ``time.monotonic()`` when the monitor started watching it.
    """

    task: TaskInfo
    address: str
    alive: bool
    missed: int
    last_seen: float | None
    reason: str
    pid: int | None
    since: float

    def seconds_unseen(self, now: float | None = None) -> float:
        """Seconds since the last answer (or since watching began, if none)."""
        now = time.monotonic() if now is None else now
        return now - (self.last_seen if self.last_seen is not None else self.since)

    def describe(self, now: float | None = None) -> str:
        """A sentence naming the peer and its state, e.g. for a log or an error."""
        name = f"task {self.task.device_name} at {self.address}"
        unseen = self.seconds_unseen(now)
        if self.alive and not self.missed:
            return f"{name} is alive (pid {self.pid})"
        seen = (f"last seen {unseen:.1f} s ago" if self.last_seen is not None
                else f"never answered in {unseen:.1f} s")
        because = f"; last beat: {self.reason}" if self.reason else ""
        verdict = "it is dead or suspended" if not self.alive else "it may be slow"
        return f"{name} missed {self.missed} heartbeats ({seen}{because}); {verdict}"


class _Peer:
    """Mutable record of one peer, guarded by the monitor's lock."""

    __slots__ = ("task", "address", "alive", "missed", "last_seen", "reason", "pid", "since")

    def __init__(self, task: TaskInfo, address: str, since: float) -> None:
        self.task, self.address, self.since = task, address, since
        self.alive, self.missed, self.last_seen = True, 0, None
        self.reason, self.pid = "", None

    def snapshot(self) -> PeerHealth:
        return PeerHealth(self.task, self.address, self.alive, self.missed, self.last_seen,
                          self.reason, self.pid, self.since)


Callback = Callable[[PeerHealth], None]


class HeartbeatMonitor:
    """Pings the peers of ``server``'s task and tracks which are alive.

    Args:
        server: this task's started server (its credentials and peer channels
            are used; stop the monitor before the server).
        peers: the tasks to watch (default: every other task of ``jobs``).
        jobs: the jobs to watch when ``peers`` is not given (default: all).
        options: beat interval, missed beats before death, beat deadline.
        on_dead: called with a :class:`PeerHealth` when a peer is declared dead.
        on_alive: called when a peer answers for the first time, or again after
            being declared dead.
        start: start beating now (else call :meth:`start`).

    Raises:
        InvalidArgumentError: a peer or job is not in the cluster.
    """

    def __init__(self, server: Server, *, peers: Iterable[TaskInfo] | None = None,
                 jobs: Sequence[str] | None = None, options: HeartbeatOptions | None = None,
                 on_dead: Callback | None = None, on_alive: Callback | None = None,
                 start: bool = True) -> None:
        self.server = server
        self.options = options or HeartbeatOptions()
        self._on_dead, self._on_alive = on_dead, on_alive
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._finished: set[TaskInfo] = set()
        now = time.monotonic()
        self._peers = {task: _Peer(task, server.cluster.task_address(task.job_name,
                                                                      task.task_index), now)
                       for task in self._select(peers, jobs)}
        if start:
            self.start()

    def _select(self, peers: Iterable[TaskInfo] | None,
                jobs: Sequence[str] | None) -> list[TaskInfo]:
        cluster = self.server.cluster
        if peers is not None:
            chosen = [TaskInfo(t.job_name, t.task_index) for t in peers]
            for task in chosen:
                cluster.validate_task(task.job_name, task.task_index)
            return chosen
        for job in jobs or ():
            cluster.num_tasks(job)  # validates the job name
        return [task for task, _ in cluster.tasks()
                if task != self.server.task and (jobs is None or task.job_name in jobs)]

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start one beating thread per peer (no-op when started)."""
        with self._lock:
            if self._threads or self._stop.is_set():
                return
            now = time.monotonic()
            for task, peer in self._peers.items():
                peer.since = now  # the startup grace counts from here
                thread = threading.Thread(target=self._beat, args=(task,), daemon=True,
                                          name=f"towerflow-heartbeat-{task}")
                self._threads.append(thread)
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating and join the threads (each finishes its beat in flight)."""
        self._stop.set()
        bound = timeout if timeout is not None else self.options.beat_timeout + 5.0
        deadline = time.monotonic() + bound
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def mark_finished(self, job_name: str, task_index: int) -> None:
        """Stop watching a peer that finished its work on purpose.

        A task that is done (a worker that reached its last step) stops its
        server; without this it would be declared dead. Its last state stays
        queryable, and it is never reported dead afterwards.

        Raises:
            InvalidArgumentError: the task is not watched by this monitor.
        """
        task = TaskInfo(job_name, task_index)
        self.health(job_name, task_index)  # validates that it is watched
        with self._lock:
            if task in self._finished:
                return
            self._finished.add(task)
        logger.info("task %s finished; no longer watched", task.device_name)

    def __enter__(self) -> HeartbeatMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries --------------------------------------------------------------------------
    def health(self, job_name: str, task_index: int) -> PeerHealth:
        """The state of one watched peer.

        Raises:
            InvalidArgumentError: the task is not watched by this monitor.
        """
        task = TaskInfo(job_name, task_index)
        with self._lock:
            peer = self._peers.get(task)
            if peer is None:
                watched = ", ".join(t.device_name for t in self._peers) or "none"
                raise InvalidArgumentError(
                    f"{task.device_name} is not watched by the heartbeat monitor of "
                    f"{self.server.task.device_name} (watched: {watched}); pass it in peers=."
                )
            return peer.snapshot()

    def peers(self) -> list[PeerHealth]:
        """Every watched peer's state."""
        with self._lock:
            return [peer.snapshot() for peer in self._peers.values()]

    def dead(self) -> list[PeerHealth]:
        """The peers declared dead (missed ``max_missed`` beats in a row), finished ones aside."""
        with self._lock:
            finished = set(self._finished)
        return [h for h in self.peers() if not h.alive and h.task not in finished]

    def is_alive(self, job_name: str, task_index: int) -> bool:
        """Whether the peer is alive (False once declared dead)."""
        return self.health(job_name, task_index).alive

    def describe_dead(self, tasks: Iterable[TaskInfo] | None = None) -> str:
        """Sentences naming the dead peers (among ``tasks``, default all); "" if none."""
        wanted = None if tasks is None else {TaskInfo(t.job_name, t.task_index) for t in tasks}
        return "; ".join(h.describe() for h in self.dead() if wanted is None or h.task in wanted)

    def check(self, tasks: Iterable[TaskInfo] | None = None) -> None:
        """Raise :class:`UnavailableError` naming the dead peers (among ``tasks``).

        Raises:
            UnavailableError: some of those peers are declared dead.
        """
        message = self.describe_dead(tasks)
        if message:
            raise UnavailableError(f"{message}. Restart the task or remove it from the cluster.")

    def wait_for(self, job_name: str, task_index: int, *, alive: bool,
                 timeout: float) -> PeerHealth:
        """Wait until the peer is declared ``alive`` (or dead); return its state.

        Raises:
            DeadlineExceededError: it did not reach that state within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while True:
            health = self.health(job_name, task_index)
            if health.alive == alive and (not alive or health.last_seen is not None):
                return health
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state = "alive" if alive else "dead"
                raise DeadlineExceededError(
                    f"{health.task.device_name} was not declared {state} within {timeout:g} s "
                    f"({health.describe()}); check the heartbeat options."
                )
            self._stop.wait(min(remaining, self.options.interval / 4))

    # -- beating --------------------------------------------------------------------------
    def _beat(self, task: TaskInfo) -> None:
        interval = self.options.interval
        while not self._stop.is_set() and not self.server.stopped and task not in self._finished:
            started = time.monotonic()
            pid, reason = self._ping(task)
            self._record(task, pid, reason)
            self._stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def _ping(self, task: TaskInfo) -> tuple[int | None, str]:
        try:
            reply = self.server.ping(task.job_name, task.task_index,
                                     timeout=self.options.beat_timeout)
        except UnavailableError:
            return None, _NO_CONNECTION
        except DeadlineExceededError:
            return None, _NO_REPLY
        except UnauthenticatedError:
            return None, "it refused our credentials: give every task the same cluster secret"
        except InvalidArgumentError as exc:
            return None, str(exc)
        except TowerflowError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        except ValueError:  # the server closed its channels while we were beating
            return None, "this task's server is stopped"
        return reply.get("pid"), ""

    def _record(self, task: TaskInfo, pid: int | None, reason: str) -> None:
        event: tuple[Callback | None, PeerHealth] | None = None
        with self._lock:
            if self._stop.is_set() or task in self._finished:
                return
            peer = self._peers[task]
            now = time.monotonic()
            if not reason:
                news = not peer.alive or peer.last_seen is None
                peer.alive, peer.missed, peer.reason = True, 0, ""
                peer.last_seen, peer.pid = now, pid
                if news:
                    event = (self._on_alive, peer.snapshot())
                    logger.info("%s", event[1].describe())
            else:
                peer.missed += 1
                peer.reason = reason
                starting = peer.last_seen is None \
                    and now - peer.since < self.options.startup_grace
                if peer.alive and not starting and peer.missed >= self.options.max_missed:
                    peer.alive = False
                    event = (self._on_dead, peer.snapshot())
                    logger.warning("%s", event[1].describe())
        if event is not None and event[0] is not None:
            try:
                event[0](event[1])
            except Exception:  # noqa: BLE001 - a callback must not stop the heartbeats
                logger.exception("heartbeat callback for %s failed", task.device_name)
