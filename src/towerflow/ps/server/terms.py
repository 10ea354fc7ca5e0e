"""The term of each shard a ps task holds, and the primary's wait for its replica.

Shared by the dense shard (:mod:`towerflow.ps.server.dense.replication`,
:mod:`towerflow.ps.server.dense.copies`) and the sparse tables
(:mod:`towerflow.ps.server.tables.replica`): ps task ``i``'s dense shard and its
table shards are shard ``i``, with one term; with ``replicas=1`` their copies live
on ps task ``(i + 1) % n``.

- :class:`ShardTerm` — the shard's term (1 from its Init) and this ps task's
  role for it (``primary``, ``replica``, or ``deposed`` once its replica took
  it over). A request naming a term is checked against it; a ps task that is
  not the primary refuses with ``FAILED_PRECONDITION`` and a sentence naming
  the shard's new term and task. ``Promote`` makes a replica the primary at
  the next term; a copy from the old primary is refused from then on, so the
  old primary, deposed by that refusal, acknowledges nothing more. A promoted
  copy serves the shard ``alone`` until the task it took it over from (or that
  task's replacement) rejoins as its copy (:meth:`ShardTerm.rejoin`,
  :mod:`towerflow.ps.server.rejoin`); a copy being caught up is not ``whole``,
  and is not promoted until its primary says it caught up.
- :class:`TermBook` — the terms of every shard one ps task holds.
- :class:`GroupCommit` — pushes that finish together wait for one copy.
- :func:`send_copy` / :func:`deposed` — a copy's call and what its refusal means.

Example:
    >>> book = TermBook(1, num_ps=2)
    >>> book.of(1).role, book.of(0).role, book.of(0).promote(), book.of(0).role
    ('primary', 'replica', 2, 'primary')
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    TowerflowError,
    UnavailableError,
)
from towerflow.ps.wire.calls import DEPOSED_MARK, REPLICA_MARK, partner_of

__all__ = ["ShardTerm", "TermBook", "GroupCommit", "CopyStream", "send_copy", "deposed",
           "check_copies",
           "REPLICA_TIMEOUT",
           "PRIMARY", "REPLICA", "DEPOSED"]

logger = logging.getLogger("towerflow.ps")

#: seconds a primary waits for its replica to acknowledge a copy
REPLICA_TIMEOUT = 10.0
PRIMARY, REPLICA, DEPOSED = "primary", "replica", "deposed"


class ShardTerm:
    """The term of one shard on one ps task and the task's role for it.

    Args:
        shard: the shard's index.
        task: the ps task holding this copy of it.
        role: ``primary`` (its own shard) or ``replica`` (a copy of another's).
        successor: the ps task that takes the shard over from this one (its replica).
        num_ps: the job's ps tasks (a promoted copy's own copy then goes to the shard's
            own task: :func:`~towerflow.ps.wire.calls.partner_of`).
    """

    __slots__ = ("shard", "task", "role", "term", "held", "successor", "alone", "num_ps",
                 "whole", "_lock")

    def __init__(self, shard: int, task: int, role: str = PRIMARY,
                 successor: int | None = None, num_ps: int | None = None) -> None:
        self.shard, self.task, self.role, self.term = shard, task, role, 1
        self.num_ps = num_ps
        #: the term this task last held the shard at as its primary (0: never)
        self.held = 1 if role == PRIMARY else 0
        self.successor = successor
        #: the primary serves the shard without its replica (the replica's task is gone)
        self.alone = False
        #: a replica's copy is whole (False from the start of a catch-up until its primary
        #: says it caught up: such a copy is not promoted)
        self.whole = True
        self._lock = threading.Lock()

    def check(self, term: int = 0) -> None:
        """Raise unless this task serves the shard as its primary at ``term`` (0: any).

        A request naming a newer term tells a primary that its replica took the
        shard over: it is deposed from then on.

        Raises:
            FailedPreconditionError: not the primary, or ``term`` is not the shard's.
        """
        with self._lock:
            if self.role == PRIMARY and term > self.term:
                self._depose(term, self.successor)
            if self.role != PRIMARY:
                raise FailedPreconditionError(self._not_primary())
            if term and term < self.term:
                raise FailedPreconditionError(
                    f"A request for shard {self.shard} named its term {term}; the shard is at "
                    f"term {self.term} on ps task {self.task} (its replica took it over). Send "
                    f"with term {self.term}.")

    def depose(self, term: int, successor: int | None) -> None:
        """The shard's replica on ``successor`` took it over at ``term``: refuse from now on."""
        with self._lock:
            self._depose(term, successor)

    def _depose(self, term: int, successor: int | None) -> None:
        if self.role == PRIMARY:
            self.held = self.term
            logger.warning("ps task %d is no longer the primary of shard %d: term %d on ps "
                           "task %s", self.task, self.shard, term, successor)
        self.role, self.term, self.successor = DEPOSED, max(self.term, term), successor

    def promote(self) -> int:
        """A replica becomes the shard's primary at the next term; return that term
        (a primary already: its term, unchanged). It has no copy of its own until the
        task it took the shard over from (or its replacement) rejoins as the copy
        (:meth:`rejoin` there, :meth:`joined` here): it serves alone till then."""
        with self._lock:
            if self.role == REPLICA and not self.whole:
                raise FailedPreconditionError(
                    f"ps task {self.task} holds a copy of shard {self.shard} that its primary "
                    f"had not finished copying to it (term {self.term}): it cannot take the "
                    "shard over, and the shard's acknowledged pushes since the last checkpoint "
                    "are gone with its primary. Restart the job from its last checkpoint.")
            if self.role == REPLICA:
                self.role, self.term = PRIMARY, self.term + 1
                self.held, self.alone = self.term, True
                if self.successor is not None:
                    self.successor = self._partner()
                logger.warning("ps task %d took shard %d over as its primary (term %d)",
                               self.task, self.shard, self.term)
            elif self.role == DEPOSED:
                raise FailedPreconditionError(self._not_primary())
            return self.term

    def _partner(self) -> int | None:
        """The ps task that holds this shard's copy while this task serves it."""
        if self.num_ps is None:
            return self.successor
        return partner_of(self.shard, self.task, self.num_ps)

    def rejoin(self, term: int, catch_up: bool = False) -> str:
        """This task takes a copy of the shard from its primary at ``term``: a replica that
        was restarted, or the primary the copy took the shard over from (its replacement, or
        itself brought back), becomes the shard's replica at that term; with ``catch_up`` its
        copy is not whole (not promoted) until :meth:`caught_up`. Return why it is refused
        ("" when taken): a primary at ``term`` or later, or a replica of a newer one."""
        with self._lock:
            if term < self.term or term == self.term and self.role == PRIMARY:
                return (f"ps task {self.task} holds shard {self.shard} at term {self.term} as "
                        f"its {self.role}; a copy from a primary at term {term} is refused.")
            if self.role != REPLICA:
                logger.warning("ps task %d holds shard %d as its replica from now on (term %d "
                               "on ps task %s)", self.task, self.shard, term,
                               self._other_task())
            self.role, self.term, self.alone = REPLICA, term, False
            self.whole = self.whole and not catch_up
            if self.num_ps is not None:
                self.successor = self._partner()
            return ""

    def caught_up(self, term: int) -> bool:
        """The primary at ``term`` finished copying the shard here: the copy is whole (it may
        take the shard over); whether it is."""
        with self._lock:
            if self.role == REPLICA and self.term == term:
                self.whole = True
            return self.whole

    def _other_task(self) -> int | None:
        return None if self.num_ps is None else partner_of(self.shard, self.task, self.num_ps)

    def joined(self) -> None:
        """The shard's copy is whole on its replica again (a catch-up ended): every push is
        acknowledged once the copy has it, from now on."""
        with self._lock:
            if self.role == PRIMARY and self.alone:
                self.alone = False
                logger.warning("ps task %d: shard %d has a live copy on ps task %s again "
                               "(term %d)", self.task, self.shard, self.successor, self.term)

    def go_alone(self) -> int:
        """The shard's replica's task is gone (a worker found it so): this primary goes on
        without a copy, acknowledging what it applied; return its term.

        Raises:
            FailedPreconditionError: this task is not the shard's primary.
        """
        with self._lock:
            if self.role != PRIMARY:
                raise FailedPreconditionError(self._not_primary())
            if not self.alone:
                logger.warning(
                    "ps task %d serves shard %d without its replica on ps task %s (gone): "
                    "its acknowledged pushes are on this task only from now on",
                    self.task, self.shard, self.successor)
            self.alone = True
            return self.term

    @contextlib.contextmanager
    def copying(self, term: int) -> Iterator[str]:
        """Hold the shard's role while a copy from the primary at ``term`` is written (a
        promotion waits for it); yields why the copy is refused ("" when it is taken)."""
        with self._lock:
            if self.role == REPLICA and term >= self.term:
                self.term = term
                yield ""
            else:
                yield (f"ps task {self.task} holds shard {self.shard} at term {self.term} as "
                       f"its {self.role}; a copy from a primary at term {term} is refused.")

    def refusal(self) -> str:
        """Why this task does not serve the shard (a sentence naming who does)."""
        with self._lock:
            return self._not_primary()

    def _not_primary(self) -> str:
        if self.role == REPLICA:
            return (f"ps task {self.task} {REPLICA_MARK} {self.shard} (term "
                    f"{self.term}); its primary serves it until the replica is promoted.")
        where = "" if self.successor is None else f" on ps task {self.successor}"
        return (f"ps task {self.task} {DEPOSED_MARK} {self.shard} (term "
                f"{self.held}, now term {self.term}{where}): its "
                f"replica took the shard over, and this task applies nothing more to it. Send "
                f"the shard's pulls and pushes{where} with term {self.term}.")


class TermBook:
    """The :class:`ShardTerm` of every shard one ps task holds, its own and its copies: the
    task's dense shard, its table shards and their copies share one per shard index.

    Args:
        task: the ps task's index (None: a table service serving any shard, in tests).
        num_ps: the job's number of ps tasks (for the successor named in refusals).
    """

    def __init__(self, task: int | None, num_ps: int | None = None) -> None:
        self.task, self.num_ps = task, num_ps
        self._terms: dict[int, ShardTerm] = {}
        self._lock = threading.Lock()

    def of(self, shard: int, role: str | None = None) -> ShardTerm:
        """The term of ``shard`` here (made on first use: this task's own shard, or any
        shard of a table service serving all, as ``primary``; another as ``replica``)."""
        with self._lock:
            term = self._terms.get(shard)
            if term is None:
                own = self.task is None or shard == self.task
                successor = None if not self.num_ps else (shard + 1) % self.num_ps
                term = self._terms[shard] = ShardTerm(
                    shard, shard if self.task is None else self.task,
                    role or (PRIMARY if own else REPLICA), successor,
                    None if self.task is None else self.num_ps)
            return term

    def get(self, shard: int) -> ShardTerm | None:
        """The term of ``shard`` when this task holds it (or a copy), else None."""
        return self._terms.get(shard)

    def held(self) -> list[ShardTerm]:
        """The terms of every shard held here (its own and its copies)."""
        with self._lock:
            return list(self._terms.values())


class GroupCommit:
    """Callers that ask together share one ``send()``: :meth:`wait` returns once a send
    begun after it was called succeeded, or raises that send's error.

    Args:
        send: sends the state as it is when it is called (raises ``TowerflowError``).
    """

    def __init__(self, send: Callable[[], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._requested = self._sent = self._failed_upto = 0
        self._failure: TowerflowError | None = None
        self._busy = False

    def wait(self) -> None:
        """Return once a send begun after this call succeeded (see the class doc)."""
        with self._cond:
            self._requested += 1
            ticket = self._requested
            while True:
                if self._sent >= ticket:
                    return
                if self._failed_upto >= ticket and self._failure is not None:
                    raise self._failure
                if not self._busy:
                    break
                self._cond.wait()
            self._busy, target = True, self._requested
        failure: TowerflowError | None = None
        try:
            self._send()
        except TowerflowError as exc:
            failure = exc
        with self._cond:
            self._busy = False
            if failure is None:
                self._sent = max(self._sent, target)
            else:
                self._failed_upto, self._failure = target, failure
            self._cond.notify_all()
        if failure is not None:
            raise failure

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Run the block while no send runs (and hold new ones off)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def send_copy(channel: Any, path: str, chunks: list[bytes], term: ShardTerm, replica_task: int,
              timeout: float) -> bytes:
    """Stream a copy's ``chunks`` to the replica's ``path``; its reply's bytes.

    Raises:
        UnavailableError: no acknowledgement within ``timeout`` (a sentence says what
            became of the push and the way out).
    """
    from towerflow.cluster.transport import stream_unary

    try:
        return stream_unary(channel, path, chunks, timeout=timeout)
    except FailedPreconditionError:
        raise
    except TowerflowError as exc:
        raise _unacknowledged(term, replica_task, timeout, exc) from None


def _unacknowledged(term: ShardTerm, replica_task: int, timeout: float,
                    exc: TowerflowError) -> UnavailableError:
    return UnavailableError(
        f"ps task {term.task} applied the push to shard {term.shard}, but its replica on "
        f"ps task {replica_task} did not acknowledge the copy within {timeout:g} s "
        f"({type(exc).__name__}: {exc}); the push is not acknowledged. Its retry is "
        "answered from the push ledger once the replica has it: start ps task "
        f"{replica_task} again, or train with replicas=0.")


class CopyStream:
    """A primary's long-lived call to its replica's copy handler: one request per copy and
    one reply each, in order (a call set up and authenticated per copy would cost both ends
    far more CPU than the copy; see ``towerflow.cluster.transport.RequestStream``).

    Its caller sends one copy at a time (:class:`GroupCommit`). A failed call is closed;
    a copy that failed on a call opened before is sent once more on a new one (a copy is
    taken whole or not at all, so twice is once), then the next copy opens another.

    Args:
        channel: ``channel()`` -> an authenticated channel to the replica's ps task.
        path: the stream method's full path.
        term: the shard's term here (for the refusal's sentence).
        replica_task: the replica's ps task.
        timeout: seconds to wait for each acknowledgement.
    """

    def __init__(self, channel: Callable[[], Any], path: str, term: ShardTerm,
                 replica_task: int, timeout: float) -> None:
        self._channel, self._path, self.term = channel, path, term
        self.replica_task, self.timeout = replica_task, timeout
        self._stream: Any = None

    def call(self, request: bytes) -> bytes:
        """Send one copy; the replica's reply.

        Raises:
            UnavailableError: no acknowledgement within the timeout (a sentence says what
                became of the push and the way out).
        """
        from towerflow.cluster.transport import RequestStream

        while True:  # a call opened before (its peer restarted since): once more, on a new one
            stream = self._stream
            reused = stream is not None and stream.fresh
            try:
                if not reused:
                    self.close()
                    stream = self._stream = RequestStream(self._channel(), self._path,
                                                          self.timeout, request)
                else:
                    stream.send(request)
                return stream.receive()
            except TowerflowError as exc:
                self.close()
                if isinstance(exc, FailedPreconditionError):
                    raise
                if not reused:
                    raise _unacknowledged(self.term, self.replica_task, self.timeout,
                                          exc) from None

    def close(self) -> None:
        """End the call (a later copy opens another)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


def check_copies(copies: int, num_ps: int | None, peer_channel: Any, what: str) -> None:
    """Raise unless ``copies`` live copies of ``what`` can be kept: fewer than the job's
    ``num_ps`` ps tasks, with a way to reach them (``peer_channel``).

    Raises:
        InvalidArgumentError: a sentence naming the value and the way out.
    """
    if peer_channel is None or not num_ps or copies >= num_ps:
        raise InvalidArgumentError(
            f"{what} asks replicas={copies}, but this job has "
            f"{num_ps or 'an unknown number of'} ps task(s); replicas must be below the "
            "number of ps tasks. Start more ps tasks or train with replicas=0.")


def deposed(term: ShardTerm, reply: Any, replica_task: int) -> FailedPreconditionError:
    """The replica refused a copy (``reply``, a ``ReplicateReply``) because it took the shard
    over: depose this task and return the error to raise."""
    term.depose(reply.term, replica_task)
    return FailedPreconditionError(f"{term.refusal()} ({reply.message})")
