"""Where a worker sends one shard's calls with ``replicas=1``, and its switch to the replica.

With ``replicas=1`` ps task ``i``'s shard has a live copy on ps task
``(i + 1) % n`` (:func:`~towerflow.ps.wire.calls.replica_of`); once that copy
took the shard over, its copy is made again on ps task ``i`` when that task
(or its replacement) is back (:func:`~towerflow.ps.wire.calls.partner_of`). A
:class:`ShardRoute` holds, for one shard, the ps task that serves it and the
term the worker believes; every request of the shard names both (a ps task
checks the term, so a primary that its replica took over refuses).

When a call to the primary fails UNAVAILABLE or DEADLINE_EXCEEDED, the route
checks that the primary is really gone (it answers no ``Status`` for
``grace`` seconds), then asks the replica's task to ``Promote`` the shard (a
second worker's ``Promote`` of a copy promoted already gets the same term),
and switches the shard's calls there with the new term; the caller sends the
call in flight again, as the same push (its ``(worker_id, incarnation, seq)``
unchanged), which the promoted copy's push ledger applies once. A primary
that says it was deposed (``FAILED_PRECONDITION``) is switched from at once. A
primary that answers while its pushes fail, because its own replica's task is
gone (it cannot have a copy acknowledged), is asked to go on without that
replica (``Promote`` of its own shard), so that training goes on.
A task that says it holds only the shard's copy, or that restarted and holds
nothing, is switched from at once too (to the shard's other task, which serves
it). The whole switch is bounded by ``timeout``; when it cannot happen (no
copy, or the copy's task down too, or its copy not caught up yet) the route
keeps a sentence saying why, and the caller's error carries it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from towerflow.cluster.transport import unary
from towerflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    TowerflowError,
    UnavailableError,
)
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import (
    DEPOSED_MARK,
    NOT_INITIALISED_MARK,
    REPLICA_MARK,
    method_path,
    partner_of,
)
from towerflow.ps.wire.framing import pack, unpack
from towerflow.ps.wire.messages import parse_message

__all__ = ["ShardRoute", "FAILOVER_GRACE", "FAILOVER_TIMEOUT", "failover_worthy",
           "routed_push"]

logger = logging.getLogger("towerflow.ps")

#: seconds a primary must answer no Status before its replica is promoted
FAILOVER_GRACE = 1.0
#: seconds the whole switch to the replica may take (probe, Promote)
FAILOVER_TIMEOUT = 5.0
_PROBE_S = 0.5


def routed_push(request: bytes | memoryview, shard: int, term: int) -> bytes | memoryview:
    """A packed dense push request (``PushPullSmall``) naming ``shard`` at ``term``: the
    request itself when it does, else re-framed with both appended to its header
    (serialised messages merge: the appended fields win)."""
    head, payload = unpack(request)
    named = pb.PushRequest.FromString(head)
    if named.term == term and named.HasField("shard") and named.shard == shard:
        return request
    return pack(head + pb.PushRequest(shard=shard, term=term).SerializeToString(), payload)


def failover_worthy(exc: BaseException) -> bool:
    """Whether ``exc`` of a call to a shard's ps task may mean that the task is gone (or
    deposed, or holds only the shard's copy, or restarted and holds nothing), so that the
    shard's other task should serve it."""
    if isinstance(exc, (UnavailableError, DeadlineExceededError)):
        return True
    return isinstance(exc, FailedPreconditionError) and _elsewhere(exc)


def _elsewhere(exc: FailedPreconditionError) -> bool:
    """Whether the task that refused with ``exc`` says the shard is not served there."""
    text = str(exc)
    return DEPOSED_MARK in text or REPLICA_MARK in text or NOT_INITIALISED_MARK in text


class ShardRoute:
    """The ps task serving one shard and the shard's term, as this worker believes.

    Args:
        shard: the shard's index (its primary is ps task ``shard``).
        num_ps: the job's number of ps tasks.
        channel_for: ``channel_for(task)`` -> the worker's channel to ps task ``task``.
        grace: seconds the primary must answer no ``Status`` before it is given up.
        timeout: seconds the whole switch may take.

    Example:
        >>> route = ShardRoute(0, 2, lambda task: None)
        >>> route.task, route.term, route.successor
        (0, 1, 1)
    """

    def __init__(self, shard: int, num_ps: int, channel_for: Callable[[int], Any], *,
                 grace: float = FAILOVER_GRACE, timeout: float = FAILOVER_TIMEOUT) -> None:
        self.shard, self.num_ps = shard, num_ps
        self.task, self.term = shard, 1
        self.grace, self.timeout = grace, timeout
        self._channel_for = channel_for
        #: why the last switch could not happen ("" when none failed)
        self.refusal = ""
        #: (monotonic time of the failure that started it, of the first call that
        #: succeeded afterwards) of the last switch, for the failover figure
        self.switched_at: float | None = None
        self._lock = threading.Lock()

    @property
    def successor(self) -> int:
        """The ps task holding the shard's copy while ``task`` serves it (the other task of
        the shard's pair: :func:`~towerflow.ps.wire.calls.partner_of`)."""
        return partner_of(self.shard, self.task, self.num_ps)

    @property
    def channel(self) -> Any:
        """The channel to the task serving the shard now."""
        return self._channel_for(self.task)

    def where(self) -> tuple[int, int]:
        """``(task, term)`` now (a caller compares it after a failed call)."""
        return self.task, self.term

    def fail_over(self, before: tuple[int, int], exc: TowerflowError) -> bool:
        """A call sent at ``before`` (:meth:`where`) failed with ``exc``: switch the shard to
        its replica when its primary is gone. True: the shard is served elsewhere now
        (switched here or by another thread): send the call again. False: stay (the
        primary answers, or no switch is possible: :attr:`refusal` says why).
        """
        with self._lock:
            if (self.task, self.term) != before:
                return True
            if not failover_worthy(exc):
                return False
            started = time.monotonic()
            deposed = isinstance(exc, FailedPreconditionError)
            successor = self.successor
            if not deposed and self._answers(self.task):
                return self._alone(successor, started)
            try:
                self.term = self._promote(successor, started + self.timeout)
            except TowerflowError as promote_error:
                self.refusal = (
                    f"shard {self.shard}'s primary, ps task {self.task}, is not serving it "
                    f"({type(exc).__name__}), and its replica on ps task {successor} could "
                    f"not take it over within {self.timeout:g} s ({type(promote_error).__name__}"
                    f": {promote_error}). A shard whose two tasks both lost it (its copy was "
                    f"not caught up yet) is back only from the last checkpoint: start ps task "
                    f"{successor} or {self.task} again and restart the job from it.")
                logger.warning("%s", self.refusal)
                return False
            old, self.task = self.task, successor
            self.refusal, self.switched_at = "", started
            logger.warning("shard %d failed over from ps task %d to its replica on ps task %d "
                           "(term %d) in %.2f s: %s", self.shard, old, self.task, self.term,
                           time.monotonic() - started, exc)
            return True

    def discover(self) -> bool:
        """Whether the shard's replica's task serves it already (promoted before this worker
        started): the shard's calls go there from now on, at its term. A worker that starts
        after a switch asks this while its primary does not answer (a starting ps task is
        no reason to promote anything)."""
        successor = self.successor
        try:
            data = unary(self._channel_for(successor), method_path("Status"), b"",
                         timeout=_PROBE_S)
        except TowerflowError:
            return False
        reply = parse_message(pb.StatusReply, data, "StatusReply")
        held = [(c.term, c.role) for c in reply.replicas if c.shard == self.shard]
        if reply.shard == self.shard and reply.initialized:  # its own shard, served again
            held.append((reply.term, reply.role))
        for term, role in held:
            if role == "primary" and term > self.term:
                with self._lock:
                    if term > self.term:
                        self.task, self.term = successor, int(term)
                return True
        return False

    def _alone(self, successor: int, started: float) -> bool:
        """The primary answers, but a push failed: when the shard's replica's task is gone
        (the primary cannot have its copies acknowledged), ask the primary to go on without
        it (``Promote`` of its own shard). True when it does."""
        if self._answers(successor):
            return False
        try:
            self._promote(self.task, started + self.timeout, alone=True)
        except TowerflowError as exc:
            logger.warning("shard %d's replica on ps task %d is gone, and its primary did not "
                           "go on without it: %s", self.shard, successor, exc)
            return False
        logger.warning("shard %d's replica on ps task %d is gone: its primary, ps task %d, "
                       "goes on without it (%.2f s)", self.shard, successor, self.task,
                       time.monotonic() - started)
        return True

    def _answers(self, task: int) -> bool:
        """Whether ps task ``task`` answers a ``Status`` within the grace period."""
        deadline = time.monotonic() + self.grace
        while True:
            try:
                unary(self._channel_for(task), method_path("Status"), b"", timeout=_PROBE_S)
                return True
            except (UnavailableError, DeadlineExceededError):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
            except TowerflowError:
                return True  # it answered, with an error of its own

    def _promote(self, task: int, deadline: float, *, alone: bool = False) -> int:
        """Ask ps task ``task`` to promote its copy of the shard (``alone``: to serve it
        without its copy); the shard's term."""
        request = pb.PromoteRequest(shard=self.shard, alone=alone).SerializeToString()
        while True:  # (a Promote of its own shard on the primary: go on without the replica)
            left = deadline - time.monotonic()
            try:
                data = unary(self._channel_for(task), method_path("Promote"), request,
                             timeout=max(0.1, left))
                return int(parse_message(pb.PromoteReply, data, "PromoteReply").term)
            except UnavailableError:
                if time.monotonic() + 0.1 >= deadline:
                    raise
                time.sleep(0.1)
