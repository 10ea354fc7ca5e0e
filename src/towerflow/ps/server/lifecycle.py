"""When a ps task's job is over: it ends by itself, or keeps the parameters for absent workers.

A ps task serves until every training replica of the cluster (the chief and
the workers) has said ``Done``; the chief says it after its final checkpoint
(its ``Done`` carries the step), so the parameters are safe on disk when the
ps goes. The task then ends with status 0 and ``Server.join()`` returns::

    ps task 0: every replica finished (/job:worker/replica:0/task:0 wrote its final checkpoint
    at step 200); ending

A replica that is not ``Done`` but dead or suspended (its heartbeats fail) has
not finished. When every replica that has not finished is away, the ps says so
and keeps the parameters for their return, up to ``idle_timeout`` seconds;
past that it ends and ``Server.join()`` raises, naming them. Without
heartbeats, "away" is "no call from any worker" for that long.

A chief that fails before it initialised the job says so in its ``Done``
(:attr:`PSService.failure`): the ps answers every worker's ``Status`` with the
chief's error, so they stop with it, and ends once every replica said
``Done`` (the workers do, having read it) or ``FAILURE_GRACE`` seconds after
the chief's; ``Server.join()`` then raises the chief's error, so every task of
the job exits non-zero within seconds of the chief.

``ServerOptions(serve_forever=True)`` (``--serve-forever``) keeps a ps
serving until it is stopped. Either way the watcher keeps the task's health
probe honest: ``NOT_SERVING`` until the chief has initialised the shard.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from towerflow.errors import AbortedError, UnavailableError

__all__ = ["JobLifecycle"]

logger = logging.getLogger("towerflow.ps")

_POLL_SECONDS = 0.25
#: without heartbeats, the ps says its replicas are away after this long without a call
_QUIET_SECONDS = 30.0
#: after a chief's failure, how long a ps waits for the workers to read it before it ends
FAILURE_GRACE = 20.0


class JobLifecycle:
    """Watches a ps task's replicas; ends the task when its job is over (see the module doc).

    Args:
        server: the ps task's ``Server`` (its options say ``serve_forever`` and
            ``idle_timeout``; :meth:`Server.end` ends it).
        service: the task's ``PSService`` (initialised or not, time of its last call).
        monitor: the ``HeartbeatMonitor`` watching the replicas, or None.
    """

    def __init__(self, server: Any, service: Any, monitor: Any = None) -> None:
        self.server, self.service, self.monitor = server, service, monitor
        self.replicas = tuple(server.cluster.replicas)
        self.serve_forever = bool(server.options.serve_forever)
        self.idle_timeout = server.options.idle_timeout
        self._finished: dict[int, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._away_since: float | None = None
        self._failed_at: float | None = None
        self._thread: threading.Thread | None = None

    @property
    def finished(self) -> dict[int, str]:
        """Replica index -> how it finished (e.g. "final checkpoint at step 200"), so far."""
        with self._lock:
            return dict(self._finished)

    def done(self, replica: int, note: str = "") -> None:
        """Replica ``replica`` said it finished (``note``: its final checkpoint, if any)."""
        with self._lock:
            first = replica not in self._finished
            self._finished.setdefault(replica, note)
        if first:
            name = (self.replicas[replica].device_name if 0 <= replica < len(self.replicas)
                    else f"worker {replica}")
            logger.info("ps task %d: %s finished%s", self.server.task.task_index, name,
                        f" ({note})" if note else "")
        self._wake.set()

    def start(self) -> None:
        """Start watching (no-op when started)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"towerflow-lifecycle-{self.server.task}")
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (idempotent; safe from the watcher's own thread)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    # -- the watcher ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self.server.health.set_serving(self.service.initialized)
            if not self.serve_forever and self._check():
                return
            self._wake.wait(_POLL_SECONDS)
            self._wake.clear()

    def _check(self) -> bool:
        """One look at the replicas; True when the task was ended."""
        finished = self.finished
        name = f"ps task {self.server.task.task_index}"
        if self.service.failure and not self.service.initialized:
            return self._failed(name, finished)
        self._failed_at = None
        if self.replicas and len(finished) >= len(self.replicas):
            notes = "; ".join(f"{self.replicas[r].device_name} {note}"
                              for r, note in sorted(finished.items()) if note)
            logger.info("%s: every replica finished%s; ending", name,
                        f" ({notes})" if notes else "")
            self.server.end(None)
            return True
        now = time.monotonic()
        away, since = self._away([r for r in range(len(self.replicas)) if r not in finished], now)
        if not away:
            if self._away_since is not None:
                logger.info("%s: a replica is back; serving on", name)
            self._away_since = None
            return False
        if self._away_since is None:
            self._away_since = since
            logger.warning("%s: %s; keeping the parameters (step %s) for their return for up to "
                           "%s", name, away, self.service.current_step(), _limit(self.idle_timeout))
        if self.idle_timeout is not None and now - self._away_since > self.idle_timeout:
            message = (f"{name} gave up after {self.idle_timeout:g} s without a live replica: "
                       f"{away}. Restart the workers within the idle timeout "
                       "(--idle-timeout), or restore the job from the chief's checkpoint.")
            logger.error("%s", message)
            self.server.end(UnavailableError(message))
            return True
        return False

    def _failed(self, name: str, finished: dict[int, str]) -> bool:
        """The chief failed before initialising: end once every replica knows (or the grace
        is over), with the chief's error; True when the task was ended."""
        now = time.monotonic()
        if self._failed_at is None:
            self._failed_at = now
        if len(finished) < len(self.replicas) and now - self._failed_at < FAILURE_GRACE:
            return False
        message = (f"{name}: the chief failed before it initialised the job: "
                   f"{self.service.failure}. Fix the chief's error and start the job again.")
        logger.error("%s", message)
        self.server.end(AbortedError(message))
        return True

    def _away(self, unfinished: list[int], now: float) -> tuple[str, float]:
        """(a sentence naming the unfinished replicas when all are away, else ""; since when)."""
        if not unfinished:
            return "", now
        if self.monitor is None:
            idle = now - self.service.last_call
            if idle < min(self.idle_timeout or _QUIET_SECONDS, _QUIET_SECONDS):
                return "", now
            return f"no replica has called for {idle:.0f} s (no heartbeats)", self.service.last_call
        states = [self.monitor.health(self.replicas[r].job_name, self.replicas[r].task_index)
                  for r in unfinished]
        if any(state.alive for state in states):
            return "", now
        names = ", ".join(state.task.device_name for state in states)
        return f"every replica that has not finished is dead or suspended ({names})", now


def _limit(seconds: float | None) -> str:
    return "ever (no idle timeout)" if seconds is None else f"{seconds:g} s (idle timeout)"


#: a heartbeat that failed on its deadline: the process accepted the connection but did not answer
_SUSPENDED_HINT = "no reply before the deadline"


def peer_state(health: Any) -> str:
    """``up``, ``suspended`` or ``dead`` from a ``PeerHealth`` (a late peer is still up)."""
    if health.alive:
        return "up"
    return "suspended" if health.reason.startswith(_SUSPENDED_HINT) else "dead"


def peer_describer(cluster: Any, monitor: Any) -> Any:
    """``describe(replica) -> (task name, heartbeat state, seconds since its last answer)``.

    The state is "" and the age -1 when nothing watches the replica.
    """
    replicas = tuple(cluster.replicas)

    def describe(replica: int) -> tuple[str, str, float]:
        if not 0 <= replica < len(replicas):
            return f"replica {replica}", "", -1.0
        task = replicas[replica]
        if monitor is None:
            return task.device_name, "", -1.0
        health = monitor.health(task.job_name, task.task_index)
        age = -1.0 if health.last_seen is None else time.monotonic() - health.last_seen
        return task.device_name, peer_state(health), age

    return describe
