"""The copies of other ps tasks' dense shards that one ps task holds (the replica's side).

With ``replicas=1`` ps task ``k`` holds a copy of shard ``(k - 1) % n``, kept
by that shard's primary (:class:`~towerflow.ps.server.dense.replication.ReplicaLink`):

- ``ReplicaInit`` (an ``InitRequest`` and its payload, as the chief's Init):
  the copy is (re)built whole;
- ``Replicate`` (a ``ReplicateRequest`` and the params and slot buffers): the
  copy takes the primary's state after pushes it applied — parameters,
  optimizer slots and step, the step and the push table — received whole
  before any of it is written, so a copy is never half of two states;
- ``Promote``: the copy becomes the shard's primary at the next term and
  serves its pulls and pushes (a request naming the shard); from then on a
  copy from the old primary is refused (``ReplicateReply.accepted`` false,
  with the new term), so the old primary acknowledges nothing more; a copy
  whose catch-up has not ended refuses to be promoted;
- ``CaughtUp``: a catch-up ended (:mod:`~towerflow.ps.server.rejoin`): the copy
  is whole again.

A task that rejoins as the copy of its own shard (it was the primary the copy
took the shard over from, or its replacement) holds it in its own service.

A copy is a :class:`~towerflow.ps.server.dense.service.PSService` of the
shard (made by the host's service), whose
:class:`~towerflow.ps.server.terms.ShardTerm` says ``replica``
until it is promoted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from towerflow.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from towerflow.ps.server.dense.replication import adopt_round, scatter
from towerflow.ps.server.terms import PRIMARY, TermBook
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.framing import receive_into, unpack
from towerflow.ps.wire.messages import parse_message, push_rows

__all__ = ["ReplicaCopies"]


class ReplicaCopies:
    """The shard copies one ps task holds, by shard index (see the module doc).

    A ps task that rejoins as the copy of its own shard (a replacement of the task
    the copy took the shard over from, or that task brought back) holds it in
    its own service (``own``), in the replica role, until it is promoted again.

    Args:
        task: this ps task's index.
        make_copy: ``make_copy(shard)`` -> a new service of ``shard`` in the replica role.
        terms: the task's :class:`~towerflow.ps.server.terms.TermBook` (the
            copies' terms, shared with the task's table service).
        own: the service of this task's own shard.
    """

    def __init__(self, task: int, make_copy: Callable[[int], Any], terms: TermBook,
                 own: Any = None) -> None:
        self.task, self.terms, self._own = task, terms, own
        self._make = make_copy
        self._copies: dict[int, Any] = {}
        self._versions: dict[int, int] = {}
        self._lock = threading.Lock()

    def get(self, shard: int) -> Any | None:
        """The copy of ``shard`` held here (this task's own shard when it rejoined as its
        replica), or None."""
        if shard == self.task and self._own is not None:
            return self._own if self._own.term.role != PRIMARY or self._own.term.term > 1 \
                else None
        return self._copies.get(shard)

    def serving(self, shard: int) -> Any:
        """The copy of ``shard`` once it was promoted (it serves the shard).

        Raises:
            FailedPreconditionError: no copy of ``shard`` is held here, or it is a
                replica still (its primary serves the shard).
        """
        copy = self._copies.get(shard)
        if copy is None:
            raise FailedPreconditionError(
                f"ps task {self.task} does not serve shard {shard}: it holds no copy of it. "
                f"Send the shard's requests to its primary (ps task {shard} unless its "
                "replica took it over).")
        copy.term.check()  # a replica (not promoted) refuses with a sentence
        return copy

    def replica_init(self, requests: Iterator[bytes]) -> bytes:
        """``ReplicaInit``: (re)build the copy of the shard the ``InitRequest`` names."""
        chunks = iter(requests)
        req = parse_message(pb.InitRequest, next(chunks, b""), "InitRequest")
        with self._lock:
            copy = self._own if req.shard == self.task else self._copies.get(req.shard)
            if copy is None:
                copy = self._copies[req.shard] = self._make(req.shard)
            refusal = copy.term.rejoin(req.term or 1, catch_up=req.catch_up)
            if refusal:
                return _refused(copy, refusal)
            copy.build(req, chunks)
            self._versions[req.shard] = 0
            return pb.ReplicateReply(accepted=True, term=copy.term.term).SerializeToString()

    def replicate(self, requests: Iterator[bytes]) -> bytes:
        """``Replicate``: take the primary's state of the shard (see the module doc)."""
        chunks = iter(requests)
        req = parse_message(pb.ReplicateRequest, next(chunks, b""), "ReplicateRequest")
        copy = self.get(req.shard)
        if copy is None or not copy.initialized:
            return pb.ReplicateReply(accepted=False, term=0, message=(
                f"ps task {self.task} holds no copy of shard {req.shard}")).SerializeToString()
        state = copy.shard.state
        slots = state.optimizer.slots
        if req.numel != state.layout.numel or list(req.slots) != list(slots):
            raise InvalidArgumentError(
                f"A copy of shard {req.shard} of {req.numel} elements with slots "
                f"{list(req.slots)} does not fit the replica's {state.layout.numel} elements "
                f"with slots {list(slots)}; the primary sends the whole shard again.")
        buffers = [np.empty(req.numel, np.float32) for _ in range(1 + len(slots))]
        receive_into(None, chunks, req.numel * len(buffers), who=f"shard {req.shard}'s primary",
                     on_chunk=lambda first, values: scatter(buffers, first, values))
        with copy.term.copying(req.term) as refusal:
            if refusal:
                return _refused(copy, refusal)
            if req.version > self._versions.get(req.shard, 0):
                adopt_round(copy, req)  # sync / ssp state, checked first (refused: no change)
                self._versions[req.shard] = req.version
                _install(copy.shard.state, buffers, req)
            return pb.ReplicateReply(accepted=True, term=copy.term.term).SerializeToString()

    def replicate_stream(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        """``ReplicateStream``: many ``Replicate`` on one long-lived call, each request a
        :func:`~towerflow.ps.wire.framing.pack` of its header and payload, one reply each."""
        from towerflow.cluster.transport import requests_until_closed

        for request in requests_until_closed(iter(requests)):
            head, payload = unpack(request)
            yield self.replicate(iter((head, payload) if len(payload) else (head,)))

    def promote(self, request: bytes) -> bytes:
        """``Promote``: the copy of the shard (dense and tables) becomes its primary at the
        next term (a copy not caught up refuses; a primary answers its term). With
        ``alone``: the shard's replica's task is gone, and this primary goes on without a
        copy (:meth:`~towerflow.ps.server.terms.ShardTerm.go_alone`) until it rejoins."""
        req = parse_message(pb.PromoteRequest, request, "PromoteRequest")
        if req.shard == self.task:
            term = self.terms.of(self.task)
        else:
            term = self.terms.get(req.shard)
        copy = self.get(req.shard)
        step = 0 if copy is None else copy.current_step() or 0
        if term is None:
            raise NotFoundError(
                f"ps task {self.task} holds no copy of shard {req.shard} to promote; the "
                f"shard's replica is on ps task {req.shard + 1} of the job (modulo the "
                "number of ps tasks), once its primary sent it the shard.")
        if req.alone:
            return pb.PromoteReply(term=term.go_alone(), step=step).SerializeToString()
        if req.shard == self.task and term.role == PRIMARY and (
                self._own is None or not self._own.initialized):
            raise FailedPreconditionError(
                f"ps task {self.task} holds nothing of shard {req.shard}: it started again and "
                "has not rejoined as the shard's copy yet.")
        return pb.PromoteReply(term=term.promote(), step=step).SerializeToString()

    def caught_up(self, request: bytes) -> bytes:
        """``CaughtUp``: the shard's primary (at the request's term) finished copying the
        shard here after it rejoined: the copy may take the shard over from now on."""
        req = parse_message(pb.PromoteRequest, request, "PromoteRequest")
        term = self.terms.get(req.shard)
        if term is None or not term.caught_up(req.term):
            raise FailedPreconditionError(
                f"ps task {self.task} holds no copy of shard {req.shard} at term {req.term} "
                "to be whole; its primary copies the shard again.")
        return pb.PromoteReply(term=term.term).SerializeToString()

    def stats(self) -> list[pb.ReplicaStat]:
        """One ``ReplicaStat`` per copy (for ``Status``)."""
        return [pb.ReplicaStat(shard=shard, term=copy.term.term, role=copy.term.role,
                               step=copy.current_step() or 0, alone=copy.term.alone,
                               version=self._versions.get(shard, 0))
                for shard, copy in sorted(self._copies.items())]


def _refused(copy: Any, message: str) -> bytes:
    return pb.ReplicateReply(accepted=False, term=copy.term.term,
                             message=message).SerializeToString()


def _install(state: Any, buffers: list[np.ndarray], req: Any) -> None:
    """Write a received copy into the replica's shard state (not serving: no push runs)."""
    np.copyto(state.params, buffers[0])
    for name, values in zip(req.slots, buffers[1:], strict=True):
        np.copyto(state.optimizer.slots[name], values)
    state.optimizer.step = req.optimizer_step
    state.admission.adopt(req.step, push_rows(req.pushes))
