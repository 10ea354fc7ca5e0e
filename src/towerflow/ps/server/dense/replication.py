"""A dense shard's live copy on another ps task: the primary's side.

With ``replicas=1`` (the chief's :class:`~towerflow.ps.wire.messages.AggregationConfig`)
shard ``i``'s copy lives on ps task ``(i + 1) % n``
(:mod:`~towerflow.ps.server.dense.copies` holds it there), under the shard's term
(:mod:`towerflow.ps.server.terms`):

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

Every mode is replicated. An async or ssp push changes the shard inside the
gate (:class:`ApplyGate`), an ssp push's wait for the staleness bound outside
it (so a copy never waits for a push that waits for a peer); each copy also
carries the aggregation's state (``RoundState``: ssp's clocks, the workers
done; :func:`round_message`). A sync step is applied, counted and answered in
the push table under the shard's admission lock, where the copy is read: the
replica receives each aggregated step, not each worker's push, and every worker
of the step is answered after it (see :mod:`~towerflow.ps.server.dense.syncstep`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from towerflow.ps.server.terms import (
    REPLICA_TIMEOUT,
    CopyStream,
    GroupCommit,
    ShardTerm,
    deposed,
    send_copy,
)
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import method_path
from towerflow.ps.wire.framing import CHUNK_BYTES, pack
from towerflow.ps.wire.messages import parse_message, push_records

__all__ = ["ApplyGate", "ReplicaLink", "adopt_round", "buffer_chunks", "replicate_header",
           "round_message", "scatter", "snapshot"]

logger = logging.getLogger("towerflow.ps")


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
        gate: the shard's :class:`ApplyGate` (default: a new one).
    """

    def __init__(self, term: ShardTerm, replica_task: int, channel: Callable[[], Any],
                 snapshot: Callable[[bool], tuple[Any, list[np.ndarray]]],
                 timeout: float = REPLICA_TIMEOUT, gate: ApplyGate | None = None) -> None:
        self.term, self.replica_task = term, replica_task
        self._channel, self._snapshot, self.timeout = channel, snapshot, timeout
        self.gate = gate or ApplyGate()
        self._commit = GroupCommit(self._copy)
        self._stream = CopyStream(channel, method_path("ReplicateStream"), term, replica_task,
                                  timeout)
        self.version = 0
        self._seeded = False

    def forward(self) -> None:
        """Return once the replica holds the shard as it is now (or newer); pushes that
        ask together share one copy.

        Raises:
            UnavailableError: the replica did not acknowledge within the timeout.
            FailedPreconditionError: the replica was promoted: this task is deposed.
        """
        if not self.term.alone:  # alone: its replica's task is gone (ShardTerm.go_alone)
            self._commit.wait()

    def seed(self, catch_up: bool = False) -> None:
        """Send the whole shard (after an Init, or a rejoin's ``catch_up``: the copy is not
        promoted until the primary says it caught up); the replica replaces its copy."""
        with self._commit.alone():
            self._send_init(catch_up)

    def _copy(self) -> None:
        if not self._seeded:
            self._send_init()
            return
        with self.gate.reading():
            header, buffers = self._snapshot(False)
            self.version += 1
        header.shard, header.term, header.version = self.term.shard, self.term.term, self.version
        data = self._stream.call(pack(header.SerializeToString(),
                                      b"".join(b.view(np.uint8).data for b in buffers)))
        reply = parse_message(pb.ReplicateReply, data, "ReplicateReply")
        if reply.accepted:
            return
        if reply.term == 0:  # the replica has no copy (restarted): it rejoins (a catch-up)
            self.term.go_alone()
            return
        raise deposed(self.term, reply, self.replica_task)

    def _send_init(self, catch_up: bool = False) -> None:
        with self.gate.reading():
            header, buffers = self._snapshot(True)
            self.version += 1
        header.catch_up = catch_up
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


def snapshot(shard: Any, init_request: Any, term: int) -> tuple[Any, list[np.ndarray]]:
    """``shard``'s (a ``DenseShard``'s) state as it is now, for its replica: a
    ``ReplicateRequest`` (without term and version), or with ``init_request`` that Init's
    ``InitRequest`` at the shard's state and ``term``; and copies of the params and slot
    buffers."""
    state = shard.state
    with state.admission.locked():  # a sync step is applied and answered under it
        buffers = [state.params.copy(), *(v.copy() for v in state.optimizer.slots.values())]
        if init_request is None:
            return replicate_header(shard), buffers
        req = pb.InitRequest()
        req.CopyFrom(init_request)
        req.step, req.optimizer_step, req.term = state.step, state.optimizer.step, term
        del req.slots[:], req.pushes[:]
        req.slots.extend(state.optimizer.slots)
        req.pushes.extend(push_records(state.admission.push_rows()))
        req.round.CopyFrom(round_message(shard))
    return req, buffers


def replicate_header(shard: Any) -> pb.ReplicateRequest:
    """The ``ReplicateRequest`` of ``shard`` (a ``DenseShard``) as it is now (no term; the
    caller holds its admission's lock)."""
    state = shard.state
    return pb.ReplicateRequest(step=state.step, optimizer_step=state.optimizer.step,
                               slots=list(state.optimizer.slots), numel=state.layout.numel,
                               pushes=push_records(state.admission.push_rows()),
                               round=round_message(shard))


def round_message(shard: Any) -> pb.RoundState:
    """The ``RoundState`` of ``shard``'s aggregation (ssp's clocks, the replicas done; the
    caller holds its admission's lock)."""
    clocks, done = shard.aggregator.round_state()
    return pb.RoundState(clocks=clocks, done=done)


def adopt_round(copy: Any, req: pb.ReplicateRequest) -> None:
    """A replica's ``copy`` (a ``PSService``) takes the aggregation state ``req`` carries,
    checked first (:func:`~towerflow.ps.server.dense.initspec.check_round`)."""
    from towerflow.ps.server.dense.initspec import check_round

    shard = copy.shard
    clocks, done = check_round(req.round, shard.config,
                               f"A copy of shard {req.shard} from its primary")
    shard.aggregator.adopt_round(clocks, done)
