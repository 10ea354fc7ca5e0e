"""The ps shard service on the cluster transport (hosted by ``towerflow.ps.server.host.ShardHost``).

Service ``towerflow.ps.PS``: its methods, the call sequence by role, the
status codes and the framing are the wire contract of
:mod:`towerflow.ps.wire`. This module is the server's side of it: it
parses each request into the contract's headers and hands them to the shard
(:class:`~towerflow.ps.server.dense.shard.DenseShard`). Each push carrier
(``Push``, ``PushPull``, ``PushPullSmall`` and its stream, and the ``RowBatch``
of the task's table service, which carries a ``PushPullSmall`` request) only
decodes its framing and calls :meth:`PSService.dense_push`, the one route of a
dense push. A ps task imports neither torch nor a GPU runtime.

Data path: a pushed chunk is used where gRPC left it (a read-only view of the
received ``bytes``, applied into the flat parameter buffer or summed into the
sync accumulator as it arrives, then freed: see
:mod:`~towerflow.ps.server.dense.aggregation`); a pulled chunk is one copy of its
range of the flat buffer, taken under that range's locks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from towerflow.errors import (
    AbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from towerflow.ps.memory import check_free_memory, release_free_memory, tune_malloc
from towerflow.ps.server.dense.admission import default_staging_limit
from towerflow.ps.server.dense.copies import ReplicaCopies
from towerflow.ps.server.dense.initspec import InitPlan, check_init
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.replication import ApplyGate, ReplicaLink, scatter, snapshot
from towerflow.ps.server.dense.reservations import StepReservations
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.server.elastic import ElasticMembers
from towerflow.ps.server.terms import (
    PRIMARY,
    REPLICA_TIMEOUT,
    TermBook,
    check_copies,
)
from towerflow.ps.server.workerstats import WorkerTable
from towerflow.ps.spec.dense import SLOT_NAMES, canonical_name
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import (
    APPLIED,
    CHIEF_REPLICA,
    REFUSED,
    SERVICE_NAME,
    failure_line,
    partner_of,
)
from towerflow.ps.wire.framing import CHUNK_BYTES, pack, receive_into, unpack
from towerflow.ps.wire.messages import (
    PushHeader,
    decode_push_header,
    layout_to_proto,
    outcome_to_reply,
    parse_message,
    push_records,
)

__all__ = ["PSService", "replica_task"]

logger = logging.getLogger("towerflow.ps")


def _receive_buffers(plan: InitPlan, chunks: Iterator[bytes], index: int
                     ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The params and slot buffers of ``plan``, filled from the Init payload.

    The buffers are mapped lazily (``np.empty``): memory grows only as the
    payload's bytes arrive and are written, never on the header's word.
    """
    numel = plan.layout.numel
    check_free_memory(plan.layout.nbytes * (2 + len(SLOT_NAMES[
        canonical_name(plan.optimizer["name"], plan.optimizer["momentum"])])),
        f"Initialising ps shard {index}")
    buffers = [np.empty(numel, np.float32) for _ in range(1 + len(plan.slots))]
    receive_into(None, chunks, plan.payload_elements, who="the chief's Init",
                 on_chunk=lambda first, values: scatter(buffers, first, values))
    return buffers[0], dict(zip(plan.slots, buffers[1:], strict=True))


def _payload(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """A streamed push's payload chunks; a call cancelled or broken part way raises
    :class:`AbortedError` (the push is suspended: its retry continues it)."""
    received = 0
    try:
        for chunk in chunks:
            received += len(chunk)
            yield chunk
    except grpc.RpcError:  # the call was cancelled or broke part way
        raise AbortedError(
            f"A push's call ended after {received} bytes of its payload; its retry "
            "continues after what of it was applied."
        ) from None


class PSService:
    """Hosts one ps shard: initialised by the chief, then pulled and pushed by workers.

    Args:
        shard_index: this ps task's index (task 0 holds the global step).
        chunk_bytes: size of streamed reply chunks.
        describe_worker: names a worker replica in messages (e.g. a sync step
            that misses gradients), with its heartbeat state when known.
        on_worker_done: called with a replica's index when it says it finished.
        replicas: the cluster's number of training replicas (chief and
            workers), when known: an Init may not name more, and a ``Done`` must
            name one of them.
        staging_bytes: bytes of pushed chunks a shard may hold while they are handled
            (default :func:`~towerflow.ps.server.dense.admission.default_staging_limit`).
        describe_peer: ``describe_peer(replica) -> (task, heartbeat,
            last_heartbeat_age)`` for the per-replica figures of ``Status``.
        confirm_join: on a ps task other than 0, asks ps task 0 whether it gave
            a joining elastic worker its id (see
            :class:`~towerflow.ps.server.elastic.ElasticMembers`).
        peer_channel: ``peer_channel(k)`` -> an authenticated channel to ps task ``k``:
            with it (and ``num_ps``) an Init asking ``replicas=1`` keeps a live copy of
            the shard on the next ps task
            (:mod:`~towerflow.ps.server.dense.replication`), and this task holds the
            copy of the previous one's (:mod:`~towerflow.ps.server.dense.copies`).
        num_ps: the job's number of ps tasks (for ``replicas``).
        replica_timeout: seconds a push waits for the replica's acknowledgement.
        task_index: the ps task this service runs on (default ``shard_index``; a
            copy of another task's shard names its host).
        role: ``primary`` (the task's own shard) or ``replica`` (a copy).
        terms: the task's shard terms (a copy shares its host's; default: new).

    Attributes:
        finished: replica -> how it finished ("" or its final checkpoint), from ``Done``.
        failure: the chief's error when it stopped before it initialised the shard
            (its ``Done`` carried it; "" otherwise; a later Init clears it).
        last_call: ``time.monotonic()`` of the last Init, Push or Pull.
        elastic: the elastic workers that joined (``Join``) and left
            (:mod:`~towerflow.ps.server.elastic`); kept across a re-``Init``.

    Creating one tunes this process's malloc for streamed chunks
    (:func:`~towerflow.ps.memory.tune_malloc` with one arena): a ps task then
    moves about twice the traffic and keeps no per-thread free heap.
    """

    def __init__(self, shard_index: int, *, chunk_bytes: int = CHUNK_BYTES,
                 describe_worker: Callable[[int], str] | None = None,
                 on_worker_done: Callable[[int], None] | None = None,
                 replicas: int | None = None, staging_bytes: int | None = None,
                 describe_peer: Callable[[int], tuple[str, str, float]] | None = None,
                 confirm_join: Callable[[Any], None] | None = None,
                 peer_channel: Callable[[int], Any] | None = None, num_ps: int | None = None,
                 replica_timeout: float = REPLICA_TIMEOUT, task_index: int | None = None,
                 role: str = PRIMARY, terms: TermBook | None = None) -> None:
        tune_malloc(one_arena=True)
        task = shard_index if task_index is None else task_index
        self.peer_channel, self.num_ps, self.replica_timeout = peer_channel, num_ps, replica_timeout
        #: the terms of the shards this task holds (its table service shares them)
        self.terms = terms or TermBook(task, num_ps)
        #: the shard's term and this task's role for it
        self.term = self.terms.of(shard_index, role)
        self._link: ReplicaLink | None = None
        #: pushes apply side by side; a copy for the replica waits for them and holds new
        #: ones off while it reads the shard
        self.gate = ApplyGate()
        self._init_request: Any = None
        #: the copies of other ps tasks' shards held here (a copy holds none itself)
        self.copies = ReplicaCopies(task, self._make_copy, self.terms, self) \
            if role == PRIMARY else None
        self.describe_peer = describe_peer
        self.elastic = ElasticMembers(shard_index, confirm=confirm_join)
        self.workers = WorkerTable(replicas, self.elastic)
        self.finished: dict[int, str] = {}
        self.failure = ""
        self.last_call = self._started = time.monotonic()
        self.replicas = replicas
        self.staging_bytes = staging_bytes
        self.shard_index = shard_index
        self.chunk_bytes = chunk_bytes
        self.describe_worker = describe_worker
        self.on_worker_done = on_worker_done
        self._lock = threading.Lock()
        self._shard: DenseShard | None = None
        self._generation = 0
        #: ps task 0: the steps of an async run's end kept for workers' next pushes
        self.reservations = StepReservations(lambda: self.shard.state.step)

    def handlers(self):  # noqa: ANN201 - grpc.GenericRpcHandler
        """The gRPC handlers of this service (to pass to ``Server``)."""
        from towerflow.cluster.transport import raw_handlers

        return raw_handlers(SERVICE_NAME, {
            "Init": ("stream_unary", self.init),
            "Status": ("unary_unary", self.status),
            "Join": ("unary_unary", self.join),
            "Push": ("stream_unary", self.push),
            "PushPull": ("stream_stream", self.push_pull),
            "PushPullSmall": ("unary_unary", self.push_pull_small),
            "PushPullSmallStream": ("stream_stream", self.push_pull_small_stream),
            "Pull": ("unary_stream", self.pull),
            "Done": ("unary_unary", self.done),
            "Ledger": ("unary_unary", self.ledger),
            "Reserve": ("unary_unary", self.reserve),
            "ReplicaInit": ("stream_unary", self.copies.replica_init),
            "Replicate": ("stream_unary", self.copies.replicate),
            "ReplicateStream": ("stream_stream", self.copies.replicate_stream),
            "Promote": ("unary_unary", self.copies.promote),
            "CaughtUp": ("unary_unary", self.copies.caught_up),
        })

    def _make_copy(self, shard: int) -> PSService:
        """A service holding this task's copy of ``shard`` (:class:`ReplicaCopies`)."""
        return PSService(shard, chunk_bytes=self.chunk_bytes, replicas=self.replicas,
                         describe_worker=self.describe_worker, staging_bytes=self.staging_bytes,
                         task_index=self.shard_index, role="replica", terms=self.terms,
                         peer_channel=self.peer_channel, num_ps=self.num_ps,
                         replica_timeout=self.replica_timeout)

    def _serving(self, shard: int, term: int) -> PSService:
        """The service that serves ``shard`` (-1: this task's own) at ``term`` here.

        Raises:
            FailedPreconditionError: this task does not serve it (a sentence says who does).
        """
        if shard < 0 or shard == self.shard_index or self.copies is None:
            self.term.check(term)
            return self
        copy = self.copies.serving(shard)
        copy.term.check(term)
        return copy

    def _snapshot(self, init: bool) -> tuple[Any, list[np.ndarray]]:
        """The shard's state as it is now, for its replica (:class:`ReplicaLink`)."""
        return snapshot(self.shard, self._init_request if init else None, self.term.term)

    def _replicate_to(self, copies: int) -> ReplicaLink | None:
        """The link to this shard's replica when the Init asks ``copies`` (None: no copy)."""
        if not copies or self.term.role != PRIMARY:
            return None
        check_copies(copies, self.num_ps, self.peer_channel, f"Init of ps shard {self.shard_index}")
        return self._new_link()

    def _new_link(self) -> ReplicaLink:
        task = partner_of(self.shard_index, self.term.task, self.num_ps)
        return ReplicaLink(self.term, task, lambda: self.peer_channel(task), self._snapshot,
                           self.replica_timeout, gate=self.gate)

    def replica_link(self) -> ReplicaLink | None:
        """The link to the shard's copy, made when this task serves the shard without one (a
        promoted copy, or a primary whose replica's task is gone: the copy's task, or its
        replacement, rejoins through it); None before the shard is initialised or where the
        job keeps no copies."""
        with self._lock:
            if self._shard is None or self._init_request is None or \
                    not self._init_request.aggregation.replicas or self.peer_channel is None:
                return None
            if self._link is None or self._link.replica_task != partner_of(
                    self.shard_index, self.term.task, self.num_ps):
                self._link = self._new_link()
            return self._link

    @property
    def replicas_kept(self) -> bool:
        """Whether the job keeps live copies of its shards (the Init asked ``replicas``)."""
        return self._init_request is not None and bool(self._init_request.aggregation.replicas)

    @property
    def initialized(self) -> bool:
        """Whether the chief has initialised the shard."""
        return self._shard is not None

    def current_step(self) -> int | None:
        """The shard's global step (None before the chief initialises it)."""
        current = self._shard
        return None if current is None else current.state.step

    @property
    def shard(self) -> DenseShard:
        """The current dense shard (its state and aggregator).

        Raises:
            FailedPreconditionError: not initialised yet.
        """
        current = self._shard
        if current is None:
            raise FailedPreconditionError(
                f"ps shard {self.shard_index} is not initialised yet; the chief initialises it "
                "(or restores it from a checkpoint) when it starts. Wait for it."
            )
        return current

    # -- handlers -----------------------------------------------------------------------
    def init(self, requests: Iterator[bytes]) -> bytes:
        """``Init`` (the chief's): create (or replace) the shard from an ``InitRequest`` and
        its payload (:meth:`build`). Only the shard's primary takes it: a copy this task
        took over serves the shard the request names; a replica or a deposed primary
        refuses with a sentence naming the term (the chief's route switches there)."""
        chunks = iter(requests)
        first = next(chunks, b"")
        req = parse_message(pb.InitRequest, first, "InitRequest")
        if self.copies is not None and req.shard != self.shard_index and req.shard >= 0:
            return self.copies.serving(req.shard).init(itertools.chain((first,), chunks))
        self.term.check()
        return self.build(req, chunks)

    def build(self, req: Any, chunks: Iterator[bytes]) -> bytes:
        """Create (or replace) the shard from an ``InitRequest`` ``req`` and its payload.

        The header is checked whole (:func:`~towerflow.ps.server.dense.initspec.check_init`)
        before anything is allocated, and the payload received whole before
        the live shard (if any) is replaced: a refused Init changes nothing.
        The push table of the replaced shard and the one the Init carries
        (from a checkpoint) are merged, so no push is applied twice across it.
        With ``replicas=1`` the shard is then copied whole to its replica
        (:class:`~towerflow.ps.server.dense.replication.ReplicaLink`); a deposed
        primary refuses the Init.
        """
        self.last_call = time.monotonic()
        plan = check_init(req, self.shard_index, self.replicas)
        link = self._replicate_to(plan.config.replicas)
        params, slots = _receive_buffers(plan, chunks, self.shard_index)
        optimizer = make_optimizer(plan.optimizer["name"], plan.layout.numel, slots=slots,
                                   **{k: v for k, v in plan.optimizer.items() if k != "name"})
        optimizer.step = plan.optimizer_step
        limit = self.staging_bytes or default_staging_limit(plan.config.total_num_replicas)
        state = ShardState(plan.layout, params, optimizer, step=plan.step, staging_limit=limit)
        state.admission.merge_pushes(plan.pushes, plan.step)
        shard = DenseShard(state, plan.config, self.describe_worker, self.elastic)
        shard.aggregator.adopt_round(*plan.round)  # a replica's copy of sync / ssp state
        with self._lock:
            previous, self._shard = self._shard, shard
            self._generation += 1
            self.failure = ""  # a chief that failed before was restarted and initialised
            self._init_request, self._link = req, link
            if previous is not None:
                state.admission.merge_pushes(previous.state.admission.push_rows(), plan.step)
        if previous is not None:
            previous.close()
        del previous
        release_free_memory()  # the Init chunks
        if link is not None and not self.term.alone:  # alone: its copy's task rejoins later
            link.seed()
        logger.info("ps shard %d initialised: %d variables, %.1f MiB, step %d, mode %s",
                    self.shard_index, len(plan.layout.segments), plan.layout.nbytes / 2**20,
                    state.step, plan.config.mode)
        return pb.Empty().SerializeToString()

    def status(self, request: bytes) -> bytes:
        """Report whether the shard is initialised, its step, layout, counters and push table
        (and its variables' segments when the request asks ``with_layout``)."""
        req = parse_message(pb.StatusRequest, request, "StatusRequest")
        if req.HasField("shard"):  # a shard this task may have taken over (checked)
            serving = self._serving(req.shard, req.term)
            if serving is not self:
                return serving.status(request)
        current = self._shard
        workers = self.workers.to_proto(self.replicas, self.describe_peer, self.finished)
        uptime = time.monotonic() - self._started
        if current is None:
            return pb.StatusReply(initialized=False, shard=self.shard_index, workers=workers,
                                  uptime=uptime, failure=self.failure).SerializeToString()
        state = current.state
        figures = state.figures()
        reply = pb.StatusReply(
            initialized=True, step=figures.step, fingerprint=state.layout.fingerprint,
            numel=state.layout.numel, stats=figures.stats, mode=current.config.mode,
            slots=list(state.optimizer.slots), optimizer_step=figures.optimizer_step,
            generation=self._generation, shard=self.shard_index, refusals=figures.refusals,
            staged_bytes=figures.staged, workers=workers, uptime=uptime,
            pushes=push_records(figures.pushes), rendezvous=current.config.rendezvous,
            segments=layout_to_proto(state.layout) if req.with_layout else (),
            term=self.term.term, role=self.term.role, alone=self.term.alone,
            replicas=self.copies.stats() if self.copies is not None else ())
        return reply.SerializeToString()

    def dense_push(self, header: PushHeader, chunks: Iterable[bytes | memoryview],
                   want_params: bool = False, active: Callable[[], bool] | None = None,
                   chunk_bytes: int | None = None) -> tuple[pb.PushReply, Iterable[bytes]]:
        """The one route of a dense push on this ps task: ``(reply, params)``.

        Every carrier (``Push``, ``PushPull``, ``PushPullSmall`` and its
        stream, a ``RowBatch``'s ``dense``) decodes its framing and calls this:
        the shard handles the push (:meth:`~towerflow.ps.server.dense.shard.DenseShard.push`),
        then the job's records of the worker are kept. With ``want_params``
        (and the push not refused) ``params`` are the parameters to send back,
        in chunks of ``chunk_bytes`` (None: one chunk), and the reply says
        their ``numel``.

        A push naming another shard (``header.shard``) goes to this task's copy of
        it once that copy was promoted; one naming a term is checked against the
        shard's (:class:`~towerflow.ps.server.terms.ShardTerm`). With a
        replica, the push is answered once the replica holds the shard after it.
        """
        serving = self._serving(header.shard, header.term)
        if serving is not self:
            return serving.dense_push(header, chunks, want_params, active, chunk_bytes)
        shard, link = self.shard, self._link
        outcome, params = shard.push(header, chunks, want_params=want_params, active=active,
                                     chunk_bytes=chunk_bytes,
                                     applying=self.gate.applying if self.replicas_kept else None)
        if link is not None:
            link.forward()
        self.last_call = time.monotonic()
        self.elastic.seen(header.worker_id)
        self.workers.record(header.worker_id, header.token, outcome.step,
                            outcome.status == APPLIED)
        reply = outcome_to_reply(outcome)
        if header.last_step and self.shard_index == 0:  # the next push's step, if one is left
            reply.next_reserved = self.reservations.after_push(
                header.worker_id, header.incarnation, header.last_step)
        if want_params and outcome.status != REFUSED:
            reply.numel = shard.layout.numel
        return reply, params

    def push(self, requests: Iterator[bytes], context: grpc.ServicerContext | None = None) -> bytes:
        """``Push``: apply (or aggregate, or refuse) one pushed gradient streamed in chunks."""
        chunks = iter(requests)
        header, _ = decode_push_header(next(chunks, b""))
        reply, _ = self.dense_push(header, _payload(chunks), active=_active(context))
        return reply.SerializeToString()

    def push_pull(self, requests: Iterator[bytes],
                  context: grpc.ServicerContext | None = None) -> Iterator[bytes]:
        """``PushPull``: push, then stream the fresh parameters back in the same call, chunk
        by chunk.

        The push was applied (or summed) as it arrived; a reply cut off
        changes nothing of it.
        """
        chunks = iter(requests)
        header, want_params = decode_push_header(next(chunks, b""))
        reply, params = self.dense_push(header, _payload(chunks), want_params, _active(context),
                                        self.chunk_bytes)
        yield reply.SerializeToString()
        yield from params

    def push_pull_small(self, request: bytes | memoryview,
                        context: grpc.ServicerContext | None = None) -> bytes:
        """``PushPull`` of a small shard: header and payload packed in one message each way
        (also the dense push a ``RowBatch`` carries)."""
        head, payload = unpack(request)
        header, want_params = decode_push_header(head)
        reply, params = self.dense_push(header, (payload,) if len(payload) else (),
                                        want_params, _active(context))
        return pack(reply.SerializeToString(), b"".join(params))

    def push_pull_small_stream(self, requests: Iterator[bytes],
                               context: grpc.ServicerContext | None = None) -> Iterator[bytes]:
        """Many ``PushPullSmall`` round trips on one long-lived call, one reply per request.

        A failure ends the call with its status, as it ends a unary call; the
        worker then opens another.
        """
        from towerflow.cluster.transport import requests_until_closed

        for request in requests_until_closed(iter(requests)):
            yield self.push_pull_small(request, context)

    def pull(self, request: bytes) -> Iterator[bytes]:
        """Stream the parameters (or an optimizer slot buffer)."""
        req = parse_message(pb.PullRequest, request, "PullRequest")
        serving = self._serving(req.shard if req.HasField("shard") else -1, req.term)
        if serving is not self:
            yield from serving.pull(request)
            return
        self.last_call = time.monotonic()
        state = self.shard.state
        name = req.buffer or "params"
        buffer = state.store.buffer(name)
        with state.admission.locked():
            head = pb.PullReply(step=state.step, numel=buffer.size,
                                optimizer_step=state.optimizer.step)
        yield head.SerializeToString()
        yield from state.read_chunks(name, self.chunk_bytes)

    def join(self, request: bytes) -> bytes:
        """Admit an elastic worker to an async job (ps task 0 gives its id); see
        :meth:`~towerflow.ps.server.elastic.ElasticMembers.join` for the refusals."""
        req = parse_message(pb.JoinRequest, request, "JoinRequest")
        current = self._shard
        config = None if current is None else current.config
        member, count = self.elastic.join(req, config)
        logger.info("ps shard %d: elastic worker %d (%s) joined at step %s (%d elastic)",
                    self.shard_index, member.worker_id, member.name, current.state.step, count)
        return pb.JoinReply(worker_id=member.worker_id, step=current.state.step, members=count,
                            max_elastic_workers=config.max_elastic_workers,
                            ticket=member.ticket).SerializeToString()

    def reserve(self, request: bytes) -> bytes:
        """``Reserve`` (ps task 0): keep a step of an asynchronous run's end for a worker's
        next push (:mod:`~towerflow.ps.server.dense.reservations`)."""
        req = parse_message(pb.ReserveRequest, request, "ReserveRequest")
        if req.HasField("shard"):  # shard 0, on the task that took it over
            serving = self._serving(req.shard, req.term)
            if serving is not self:
                return serving.reserve(request)
        if self.shard_index != 0:
            raise InvalidArgumentError(
                f"Reserve was sent to ps task {self.shard_index}; the global step, and the "
                "steps kept of a run's end, are ps task 0's.")
        step = self.shard.state.step
        granted = req.last_step > 0 and self.reservations.reserve(
            req.worker_id, req.incarnation, req.last_step)
        return pb.ReserveReply(granted=granted, step=step).SerializeToString()

    def done(self, request: bytes) -> bytes:
        """A worker has finished: the shard stops waiting for it (sync and ssp).

        The chief's ``Done`` says at which step it wrote its final checkpoint.
        An elastic worker's ``Done`` retires its id (it is no replica: the
        job's end does not wait for it).
        """
        req = parse_message(pb.DoneRequest, request, "DoneRequest")
        if self.elastic.leave(req.worker_id, req.ticket):
            self.reservations.release(req.worker_id)
            logger.info("ps shard %d: elastic worker %d left (%d elastic)", self.shard_index,
                        req.worker_id, len(self.elastic))
            return pb.Empty().SerializeToString()
        if self.replicas is not None and not 0 <= req.worker_id < self.replicas:
            raise InvalidArgumentError(
                f"Done from worker {req.worker_id} was refused: the cluster's replicas are "
                f"0 .. {self.replicas - 1}."
            )
        self.reservations.release(req.worker_id)
        current = self._shard
        if current is not None:
            current.worker_done(req.worker_id)
            for copy in self._held_copies():  # a step of a shard taken over stops waiting too
                copy.shard.worker_done(req.worker_id)
        elif req.failure and req.worker_id == CHIEF_REPLICA:
            self._chief_failed(req.failure)
        if self.replicas is not None or len(self.finished) < 1024:  # bounded
            self.finished.setdefault(req.worker_id, f"wrote its final checkpoint at step "
                                     f"{req.checkpoint_step}" if req.final_checkpoint else "")
        if self.on_worker_done is not None:
            self.on_worker_done(req.worker_id)
        return pb.Empty().SerializeToString()

    def _held_copies(self) -> list[PSService]:
        """The initialised copies of other tasks' shards held here (replicas or promoted)."""
        held = [] if self.copies is None or not self.num_ps else [
            self.copies.get(shard) for shard in range(self.num_ps) if shard != self.shard_index]
        return [copy for copy in held if copy is not None and copy.initialized]

    def _chief_failed(self, failure: str) -> None:
        """Keep the chief's error (first line, printable, bounded) for the workers' Status."""
        text = failure_line(failure)
        with self._lock:
            if self._shard is None:
                self.failure = text
        logger.error("ps shard %d: the chief failed before it initialised the job: %s",
                     self.shard_index, text)

    def ledger(self, request: bytes) -> bytes:
        """The pushes the shard applied since it was initialised (an audit trail).

        An entry covers the whole buffer, or (``partial``) the prefix of a push
        refused part way (:class:`~towerflow.ps.server.dense.records.LedgerRecord`).
        """
        req = parse_message(pb.LedgerRequest, request, "LedgerRequest")
        admission = self.shard.state.admission
        first, entries = admission.ledger_since(req.since)
        return pb.LedgerReply(first=first, total=admission.ledger_total, entries=[
            pb.LedgerEntry(**record._asdict()) for record in entries
        ]).SerializeToString()


def _active(context: grpc.ServicerContext | None) -> Callable[[], bool] | None:
    """Whether a call is still going (a push that waits stops when it is not); None: unknown."""
    return None if context is None else context.is_active


def replica_task(cluster, replica: int):  # noqa: ANN001, ANN201 - cluster types
    """The ``TaskInfo`` of training replica ``replica`` (the cluster's roles), or None."""
    replicas = cluster.replicas
    return replicas[replica] if 0 <= replica < len(replicas) else None


def _worker_describer(cluster, monitor) -> Callable[[int], str]:  # noqa: ANN001
    """``describe(replica)``: its task name, or its heartbeat state when it misses beats."""

    def describe(replica: int) -> str:
        task = replica_task(cluster, replica)
        if task is None:
            return f"replica {replica}"
        if monitor is not None:
            health = monitor.health(task.job_name, task.task_index)
            if health.missed:
                return health.describe()
        return task.device_name

    return describe
