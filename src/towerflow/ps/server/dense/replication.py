"""A dense shard's live copy on another ps task: the primary's side, and the shard's term.

With ``replicas=1`` (the chief's :class:`~towerflow.ps.wire.messages.AggregationConfig`)
shard ``i``'s copy lives on ps task ``(i + 1) % n``
(:mod:`~towerflow.ps.server.dense.copies` holds it there):

- :class:`ShardTerm` — the shard's term (1 from its Init) and this ps task's
  role for it (``primary``, ``replica``, or ``deposed`` once its replica took
  it over). A request naming a term (``PushRequest.term``) is checked against
  it; a ps task that is not the primary refuses with ``FAILED_PRECONDITION``
  and a sentence naming the shard's new term and task.
- :class:`ReplicaLink` — the primary's connection to its replica. After the
  Init the primary sends the whole shard (``ReplicaInit``, an ``InitRequest``
  and its payload); after each push it applied it sends the shard's state
  (``Replicate``: the parameters and optimizer slots as they are after the
  push, the step and the push table), and the push is acknowledged to the
  worker only once the replica acknowledged that state. The applied values
  travel, not the gradient, so the copy is bit-identical to the primary.
  Pushes that finish together share one copy (:meth:`ReplicaLink.forward`),
  and each copy is taken while no push is part way applied
  (:class:`ApplyGate`), so the copy's parameters and push table agree: a
  push is in both or in neither. A replica that refuses the copy because it
  was promoted deposes this primary (it never acknowledges again); one that
  has no copy (it was restarted) is sent the whole shard first. A replica
  that cannot be reached within the link's timeout fails the push with
  ``UNAVAILABLE`` (applied here, not acknowledged): its retry is answered
  from the push ledger once the replica has it.

Only an async shard is replicated so far (an Init asking ``replicas`` in sync
or ssp mode is refused with a sentence).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from towerflow.errors import FailedPreconditionError, TowerflowError, UnavailableError
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import method_path
from towerflow.ps.wire.framing import CHUNK_BYTES
from towerflow.ps.wire.messages import parse_message, push_records

__all__ = ["ShardTerm", "TermBook", "GroupCommit", "ApplyGate", "ReplicaLink", "REPLICA_TIMEOUT",
           "PRIMARY", "REPLICA", "DEPOSED", "buffer_chunks", "scatter", "replicate_header",
           "send_copy", "deposed"]

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
    """

    __slots__ = ("shard", "task", "role", "term", "held", "successor", "_lock")

    def __init__(self, shard: int, task: int, role: str = PRIMARY,
                 successor: int | None = None) -> None:
        self.shard, self.task, self.role, self.term = shard, task, role, 1
        #: the term this task last held the shard at as its primary (0: never)
        self.held = 1 if role == PRIMARY else 0
        self.successor = successor
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
        (a primary already: its term, unchanged)."""
        with self._lock:
            if self.role == REPLICA:
                self.role, self.term = PRIMARY, self.term + 1
                self.held = self.term
                logger.warning("ps task %d took shard %d over as its primary (term %d)",
                               self.task, self.shard, self.term)
            elif self.role == DEPOSED:
                raise FailedPreconditionError(self._not_primary())
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
            return (f"ps task {self.task} holds only a replica of shard {self.shard} (term "
                    f"{self.term}); its primary serves it until the replica is promoted.")
        where = "" if self.successor is None else f" on ps task {self.successor}"
        return (f"ps task {self.task} is no longer the primary of shard {self.shard} (term "
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
                    role or (PRIMARY if own else REPLICA), successor)
            return term

    def get(self, shard: int) -> ShardTerm | None:
        """The term of ``shard`` when this task holds it (or a copy), else None."""
        return self._terms.get(shard)


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


class ApplyGate:
    """Pushes apply side by side (:meth:`applying`); a copy waits for them and holds new
    ones off while it reads the shard (:meth:`reading`)."""

    __slots__ = ("_cond", "_applying", "_reading")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._applying = 0
        self._reading = False

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        with self._cond:
            while self._reading:
                self._cond.wait()
            self._applying += 1
        try:
            yield
        finally:
            with self._cond:
                self._applying -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._reading:
                self._cond.wait()
            self._reading = True
            while self._applying:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()


def scatter(buffers: list[np.ndarray], first: int, values: np.ndarray) -> None:
    """Copy ``values`` (elements ``first..`` of ``buffers`` laid end to end) into place."""
    size = buffers[0].size
    while values.size:
        index, offset = divmod(first, size)
        take = min(values.size, size - offset)
        buffers[index][offset:offset + take] = values[:take]
        values, first = values[take:], first + take


def buffer_chunks(buffers: list[np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of ``buffers`` end to end, in chunks of at most ``chunk_bytes``."""
    for buffer in buffers:
        raw = buffer.view(np.uint8)
        for start in range(0, raw.size, chunk_bytes):
            yield raw[start:start + chunk_bytes].tobytes()


class ReplicaLink:
    """The primary's side of its shard's copy on another ps task (see the module doc).

    Args:
        term: the shard's :class:`ShardTerm` on this (the primary's) task.
        replica_task: the ps task holding the copy.
        channel: ``channel()`` -> an authenticated channel to ``replica_task``.
        snapshot: ``snapshot(init)`` -> ``(header, buffers)`` of the shard as it is
            now: an ``InitRequest`` when ``init``, else a ``ReplicateRequest``
            (without term and version), and the params and slot buffers (copies).
        timeout: seconds to wait for the replica's acknowledgement.
    """

    def __init__(self, term: ShardTerm, replica_task: int, channel: Callable[[], Any],
                 snapshot: Callable[[bool], tuple[Any, list[np.ndarray]]],
                 timeout: float = REPLICA_TIMEOUT) -> None:
        self.term, self.replica_task = term, replica_task
        self._channel, self._snapshot, self.timeout = channel, snapshot, timeout
        self.gate = ApplyGate()
        self._commit = GroupCommit(self._copy)
        self.version = 0
        self._seeded = False

    def forward(self) -> None:
        """Return once the replica holds the shard as it is now (or newer); pushes that
        ask together share one copy.

        Raises:
            UnavailableError: the replica did not acknowledge within the timeout.
            FailedPreconditionError: the replica was promoted: this task is deposed.
        """
        self._commit.wait()

    def seed(self) -> None:
        """Send the whole shard (after an Init); the replica replaces its copy with it."""
        with self._commit.alone():
            self._send_init()

    def _copy(self) -> None:
        if not self._seeded:
            self._send_init()
            return
        with self.gate.reading():
            header, buffers = self._snapshot(False)
            self.version += 1
        header.shard, header.term, header.version = self.term.shard, self.term.term, self.version
        data = self._call("Replicate", header, buffers)
        reply = parse_message(pb.ReplicateReply, data, "ReplicateReply")
        if reply.accepted:
            return
        if reply.term == 0:  # the replica has no copy (it was restarted): the whole shard
            self._send_init()
            return
        raise deposed(self.term, reply, self.replica_task)

    def _send_init(self) -> None:
        with self.gate.reading():
            header, buffers = self._snapshot(True)
            self.version += 1
        data = self._call("ReplicaInit", header, buffers)
        reply = parse_message(pb.ReplicateReply, data, "ReplicateReply")
        if not reply.accepted:
            raise deposed(self.term, reply, self.replica_task)
        self._seeded = True
        logger.info("ps task %d: shard %d copied whole to its replica on ps task %d",
                    self.term.task, self.term.shard, self.replica_task)

    def _call(self, method: str, header: Any, buffers: list[np.ndarray]) -> bytes:
        chunks = [header.SerializeToString(), *buffer_chunks(buffers)]
        return send_copy(self._channel(), method_path(method), chunks, self.term,
                         self.replica_task, self.timeout)


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
        raise UnavailableError(
            f"ps task {term.task} applied the push to shard {term.shard}, but its replica on "
            f"ps task {replica_task} did not acknowledge the copy within {timeout:g} s "
            f"({type(exc).__name__}: {exc}); the push is not acknowledged. Its retry is "
            "answered from the push ledger once the replica has it: start ps task "
            f"{replica_task} again, or train with replicas=0."
        ) from None


def deposed(term: ShardTerm, reply: Any, replica_task: int) -> FailedPreconditionError:
    """The replica refused a copy (``reply``, a ``ReplicateReply``) because it took the shard
    over: depose this task and return the error to raise."""
    term.depose(reply.term, replica_task)
    return FailedPreconditionError(f"{term.refusal()} ({reply.message})")


def replicate_header(shard: Any) -> pb.ReplicateRequest:
    """The ``ReplicateRequest`` of ``shard`` (a ``DenseShard``) as it is now (no term)."""
    state = shard.state
    return pb.ReplicateRequest(step=state.step, optimizer_step=state.optimizer.step,
                               slots=list(state.optimizer.slots), numel=state.layout.numel,
                               pushes=push_records(state.admission.push_rows()))
