"""The sparse table service ``towerflow.ps.Tables``, hosted by every ps task.

Each ps task serves shard ``i`` (its task index) of every sparse embedding
table next to its dense shard (``towerflow.ps.PS``); the messages are in
``tables.proto``:

======================  ===============  ====================================
method                  kind             messages
======================  ===============  ====================================
``InitTable``           unary            ``InitTableRequest`` ->
                                         ``InitTableReply``; idempotent for
                                         the same description, refused
                                         (``FAILED_PRECONDITION``) for another
``PullRows``            unary            ``PullRowsRequest`` -> ``PullRowsReply``
``PushRows``            unary            ``PushRowsRequest`` -> ``PushRowsReply``
``PushPullRows``        unary            ``PushPullRowsRequest`` ->
                                         ``PushPullRowsReply``: a push
                                         (optional), then a pull of the same
                                         table shard under one hold of its lock
``PushPullRowsStream``  stream-stream    many ``PushPullRows`` on one
                                         long-lived call, one reply per
                                         request in order
``RowBatch``            unary            ``RowBatchRequest`` ->
                                         ``RowBatchReply``: the
                                         ``PushPullRows`` of many table
                                         shards, all checked before any
                                         is applied, then applied in order;
                                         then the task's dense push-and-pull
                                         it may carry (``dense``)
``RowBatchStream``      stream-stream    many ``RowBatch`` on one long-lived
                                         call (a worker's hot path: one
                                         stream per ps task, one request
                                         per step for all its tables)
``ExportRows``          unary -> stream  ``ExportRowsRequest`` -> ``RowChunk`` ...
``ImportRows``          stream -> unary  ``RowChunk`` ... -> ``ImportRowsReply``
``TableStatus``         unary            ``TableStatusRequest`` ->
                                         ``TableStatusReply``
``Done``                unary            ``TablesDoneRequest`` ->
                                         ``TablesDoneReply``: a worker
                                         finished (sync and ssp stop
                                         waiting for it)
``ReplicaInitTable``    unary            (a primary to its replica's ps task,
                                         ``replicas=1``) ``InitTableRequest``
                                         -> ``InitTableReply``
``ReplicateRows``       stream -> unary  ``RowChunk`` ... -> ``ReplicateReply``
                                         (:mod:`~towerflow.ps.server.tables.replica`)
``ReplicateRowsStream`` stream-stream    many ``ReplicateRows`` of one chunk
                                         each on one long-lived call
======================  ===============  ====================================

The handlers are raw-bytes handlers of
:func:`towerflow.cluster.transport.raw_handlers`, so every call is
authenticated as the dense service's are. Bad input (ids negative, out of the
table, owned by another shard, of the wrong dtype or byte count, NaN or
infinite values, an unknown table) is refused with ``INVALID_ARGUMENT`` /
``NOT_FOUND`` and a message naming the value; nothing is applied.

This module imports no torch: a ps task that never holds a table does not
load it (:mod:`towerflow.ps.server.tables.shard` is imported by the first
``InitTable``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from towerflow.cluster.transport import raw_handlers, requests_until_closed
from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from towerflow.ps.server.tables.records import DenseNeighbour, JobWorkers
from towerflow.ps.server.terms import (
    PRIMARY,
    REPLICA,
    REPLICA_TIMEOUT,
    TermBook,
    check_copies,
)
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import pack_parts, split_parts, unpack
from towerflow.ps.wire.messages import AggregationConfig, parse_message, push_records
from towerflow.ps.wire.tensors import encode, raw_bytes

__all__ = ["TableService", "TableHost", "SERVICE_NAME", "DEFAULT_CHUNK_ROWS", "MAX_BATCH_ITEMS"]

logger = logging.getLogger("towerflow.ps")

SERVICE_NAME = tpb.DESCRIPTOR.services_by_name["Tables"].full_name
#: rows per export chunk when the caller gives none
DEFAULT_CHUNK_ROWS = 1 << 14
_MAX_CHUNK_ROWS = 1 << 20
#: most items one ``RowBatch`` may carry (a model's tables x pieces per table)
MAX_BATCH_ITEMS = 1 << 16


def _aggregation(text: str) -> Any:
    """The ``AggregationConfig`` of an ``InitTableRequest.aggregation`` (None: async)."""
    if not text:
        return None
    try:
        fields = json.loads(text)
        return AggregationConfig(**fields)
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"InitTable's aggregation {text[:200]!r} is not an AggregationConfig's JSON "
            f"({str(exc)[:200]}); client and ps must run the same towerflow version."
        ) from None


def _active(context: grpc.ServicerContext | None) -> Any:
    """Whether a call is still going (a waiting push stops when it is not); None: unknown."""
    return None if context is None else context.is_active


class TableService:
    """The table shards of one ps task behind gRPC.

    Args:
        task_index: the ps task's index; an ``InitTable`` for another shard
            is refused. None: any shard (tests serving several in one process).
        peer_channel: ``peer_channel(k)`` -> an authenticated channel to ps task ``k``:
            with it (and ``num_ps``) a fixed table whose ``InitTable`` asks ``replicas=1``
            keeps a live copy on the next ps task (:mod:`~towerflow.ps.server.tables.replica`).
        num_ps: the job's number of ps tasks.
        replica_timeout: seconds a push waits for the replica's acknowledgement.

    Attributes:
        workers: the job's current workers, whose pushes the tables take and keep
            records of (:class:`~towerflow.ps.server.tables.records.JobWorkers`: any id
            until :meth:`serve_beside` points it at the task's dense shard).
    """

    def __init__(self, task_index: int | None = None, *,
                 peer_channel: Any = None, num_ps: int | None = None,
                 replica_timeout: float = REPLICA_TIMEOUT) -> None:
        self.task_index = task_index
        self.peer_channel, self.num_ps, self.replica_timeout = peer_channel, num_ps, replica_timeout
        #: the terms of the shards held here (the dense shard's, once served beside it)
        self.terms = TermBook(task_index, num_ps)
        self._copies: Any = None  # the copies of other tasks' table shards (made on first use)
        #: the InitTable request of every table shard with a copy (its replica is made of it)
        self._requests: dict[tuple[str, int], bytes] = {}
        self.workers = JobWorkers()
        self._tables: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()  # guards the dict only; each shard has its own

    @property
    def dense(self) -> DenseNeighbour | None:
        """The ps task's dense shard service (:meth:`serve_beside`); None where none is served."""
        return self.workers.ps  # type: ignore[return-value]

    def serve_beside(self, dense: DenseNeighbour) -> None:
        """Serve next to the ps task's dense shard service ``dense``: count the job's workers
        as it does (its ``Init`` and elastic membership:
        :class:`~towerflow.ps.server.tables.records.JobWorkers`) and hand it the dense push a
        ``RowBatch`` carries (its ``push_pull_small``, the dense shard's small-message carrier).
        """
        self.workers.ps = dense
        self.terms = getattr(dense, "terms", self.terms)

    def handlers(self) -> Any:
        """The ``towerflow.ps.Tables`` gRPC service."""
        return raw_handlers(SERVICE_NAME, {
            "InitTable": ("unary_unary", self.init_table),
            "PullRows": ("unary_unary", self.pull_rows),
            "PushRows": ("unary_unary", self.push_rows),
            "PushPullRows": ("unary_unary", self.push_pull_rows),
            "PushPullRowsStream": ("stream_stream", self.push_pull_rows_stream),
            "RowBatch": ("unary_unary", self.row_batch),
            "RowBatchStream": ("stream_stream", self.row_batch_stream),
            "ExportRows": ("unary_stream", self.export_rows),
            "ImportRows": ("stream_unary", self.import_rows),
            "TableStatus": ("unary_unary", self.table_status),
            "Done": ("unary_unary", self.done),
            "TableStats": ("unary_unary", self.table_stats),
            "ReplicaInitTable": ("unary_unary", self.replica_init_table),
            "ReplicateRows": ("stream_unary", self.replicate_rows),
            "ReplicateRowsStream": ("stream_stream", self.replicate_rows_stream),
        })

    def table(self, name: str, shard: int, term: int = 0) -> Any:
        """The :class:`~towerflow.ps.server.tables.shard.TableShard` ``(name, shard)`` this
        task serves: its own, or its copy of another task's once promoted; a request naming
        a ``term`` is checked against the shard's.

        Raises:
            NotFoundError: no such table shard here.
            FailedPreconditionError: this task is not the shard's primary (a sentence
                names the term and the task that is).
        """
        found = self._tables.get((name, shard))
        if found is None and self._copies is not None:
            found = self._copies.get(name, shard)
        if found is not None:
            self.terms.of(shard).check(term)
        else:
            held = sorted(f"{n}[{s}]" for n, s in self._tables)
            raise NotFoundError(
                f"Table {name!r} shard {shard} is not on this ps task (it holds "
                f"{held or 'no tables'}); the chief creates it with InitTable first."
            )
        return found

    # -- handlers ------------------------------------------------------------------------
    def init_table(self, data: bytes) -> bytes:
        from towerflow.ps.server.tables.shard import TableShard
        from towerflow.ps.wire.tables import describe_table_spec

        request = parse_message(tpb.InitTableRequest, data, "InitTable")
        spec, aggregation = request.spec, _aggregation(request.aggregation)
        taken = None if self._copies is None else self._copies.get(spec.name, spec.shard)
        if taken is not None and spec.shard != self.task_index:  # a shard taken over here
            self.terms.of(spec.shard).check()  # (a replica still: refused, naming the term)
            return self._created(taken, created=False, term=self.terms.of(spec.shard))
        if self.task_index is not None and spec.shard != self.task_index:
            raise InvalidArgumentError(
                f"InitTable for shard {spec.shard} of table {spec.name!r} reached ps task "
                f"{self.task_index}, which holds shard {self.task_index}; send shard i to ps "
                "task i."
            )
        self.terms.of(spec.shard).check()  # a replica (or a deposed primary) refuses
        description = describe_table_spec(spec)
        replicated = self._check_replicas(spec, description, aggregation)
        with self._lock:
            held = self._tables.get((spec.name, spec.shard))
            if held is not None:
                if not held.same_table(description, aggregation):
                    raise FailedPreconditionError(
                        f"Table {spec.name!r} shard {spec.shard} exists as {held.description!r:.400}"
                        f" ({held.aggregation or 'async'}) and cannot become "
                        f"{description!r:.400} ({aggregation or 'async'}); give the new table "
                        "another name or restart the ps tasks."
                    )
                created = False
            else:
                held = TableShard(spec, aggregation, self.workers)
                self._tables[(spec.name, spec.shard)] = held
                created = True
                logger.info("table %r shard %d: %d rows x %d (%d bytes with slots)", spec.name,
                            spec.shard, held.store.num_rows, held.store.dim, held.store.nbytes)
                if replicated:
                    self._requests[(spec.name, spec.shard)] = data
                    held.replica = self.replica_for(held)
        return self._created(held, created=created, term=self.terms.of(spec.shard))

    @staticmethod
    def _created(held: Any, *, created: bool, term: Any) -> bytes:
        """The ``InitTableReply`` of ``held`` once its replica has the table and every row
        (unless its primary serves it alone: its copy's task rejoins later)."""
        if held.replica is not None and not term.alone:
            held.replica.forward()
        status = held.status()
        return tpb.InitTableReply(created=created, rows=status["rows"],
                                  nbytes=status["nbytes"]).SerializeToString()

    def _check_replicas(self, spec: Any, description: Any, aggregation: Any) -> bool:
        """Whether the table shard keeps a copy on the next ps task (its InitTable asks
        ``replicas``); refuse what cannot have one."""
        copies = 0 if aggregation is None else aggregation.replicas
        if not copies or self.terms.of(spec.shard).role != PRIMARY:
            return False
        check_copies(copies, self.num_ps, self.peer_channel, f"InitTable of table {spec.name!r}")
        return True

    def replica_for(self, shard: Any) -> Any:
        """The primary's side of ``shard``'s copy (a ``TableShard`` this task serves), on the
        task that holds the copy while this one serves it (made when missing, or when the
        copy moved: a promoted copy's own copy goes to the task it took the shard over from)."""
        from towerflow.ps.server.tables.replica import RowReplica
        from towerflow.ps.wire.calls import partner_of

        term = self.terms.of(shard.shard)
        task = partner_of(shard.shard, term.task, self.num_ps)
        if shard.replica is None or shard.replica.replica_task != task:
            shard.replica = RowReplica(
                shard, term, task, lambda: self.peer_channel(task),
                self._requests[(shard.name, shard.shard)],
                lambda method: f"/{SERVICE_NAME}/{method}", self.replica_timeout)
        return shard.replica

    def served(self, shard: int) -> list[Any]:
        """The table shards of index ``shard`` this task serves with a copy kept (its own,
        or its copies it took over), for a catch-up of their copy."""
        with self._lock:
            held = [t for (n, s), t in self._tables.items() if s == shard]
            if self._copies is not None:
                held += self._copies.of_shard(shard)
        return [t for t in held if (t.name, shard) in self._requests]

    def replica_init_table(self, data: bytes) -> bytes:
        """``ReplicaInitTable``: make this task's copy of another task's table shard."""
        from towerflow.ps.server.tables.replica import TableCopies
        from towerflow.ps.server.tables.shard import TableShard

        request = parse_message(tpb.InitTableRequest, data, "ReplicaInitTable")
        spec = request.spec
        refusal = self.terms.of(spec.shard, REPLICA).rejoin(request.term or 1,
                                                             catch_up=request.catch_up)
        if refusal:
            raise FailedPreconditionError(refusal)
        aggregation = _aggregation(request.aggregation)
        with self._lock:
            if self._copies is None:
                self._copies = TableCopies(
                    self.terms, lambda spec, config: TableShard(spec, config, self.workers))
            # its own shard, rejoined as the copy: the table it held before is stale
            self._tables.pop((spec.name, spec.shard), None)
            request.term, request.catch_up = 0, False
            self._requests[(spec.name, spec.shard)] = request.SerializeToString()
        held = self._copies.init_table(request, aggregation)
        status = held.status()
        return tpb.InitTableReply(created=True, rows=status["rows"],
                                  nbytes=status["nbytes"]).SerializeToString()

    def replicate_rows(self, chunks: Iterator[bytes]) -> bytes:
        """``ReplicateRows``: a primary's changed rows for this task's copy of its shard."""
        if self._copies is None:
            from towerflow.ps.wire import ps_pb2 as pb

            return pb.ReplicateReply(accepted=False, term=0, message=(
                f"ps task {self.task_index} holds no table copies")).SerializeToString()
        return self._copies.replicate(chunks)

    def replicate_rows_stream(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        """Many ``ReplicateRows`` of one chunk each on one long-lived call, one reply each."""
        for request in requests_until_closed(iter(requests)):
            yield self.replicate_rows(iter((request,)))

    @staticmethod
    def _forward(*shards: Any) -> None:
        """Return once the replicas of ``shards`` hold what was applied to them (replicas=1)."""
        for shard in dict.fromkeys(shards):
            if shard.replica is not None:
                shard.replica.forward()

    def done(self, data: bytes) -> bytes:
        """Worker ``worker_id`` has finished: no table shard here waits for it any more.

        (A worker that pushes again afterwards, e.g. restarted, is waited for again.) The
        copies of other tasks' shards held here hear it too, so a copy that takes its shard
        over does not wait for a worker that finished.
        """
        request = parse_message(tpb.TablesDoneRequest, data, "Done")
        with self._lock:
            shards = list(self._tables.values())
        if self._copies is not None:
            shards += self._copies.of_shard(None)
        for shard in shards:
            shard.worker_done(request.worker_id)
        return tpb.TablesDoneReply().SerializeToString()

    def pull_rows(self, data: bytes) -> bytes:
        request = parse_message(tpb.PullRowsRequest, data, "PullRows")
        shard = self.table(request.table, request.shard)
        rows = shard.pull(request.ids, request.num_ids)
        return tpb.PullRowsReply(num_ids=request.num_ids, dim=shard.store.dim,
                                 dtype=str(shard.dtype).removeprefix("torch."),
                                 rows=rows).SerializeToString()

    def push_rows(self, data: bytes, context: grpc.ServicerContext | None = None) -> bytes:
        request = parse_message(tpb.PushRowsRequest, data, "PushRows")
        shard = self.table(request.table, request.shard)
        outcome, applied = shard.push(request, _active(context))
        self._forward(shard)
        return tpb.PushRowsReply(status=outcome.status, message=outcome.message,
                                 duplicate=outcome.duplicate,
                                 applied=applied).SerializeToString()

    def push_pull_rows(self, data: bytes, context: grpc.ServicerContext | None = None) -> bytes:
        request = parse_message(tpb.PushPullRowsRequest, data, "PushPullRows")
        shard, checked = self._check_item(request)
        outcome, applied, rows = shard.run(checked, _active(context))
        if request.HasField("push"):
            self._forward(shard)
        return self._item_reply(shard, request.pull, outcome, applied, encode(rows)
                                ).SerializeToString()

    def _check_item(self, request: Any, parts: Iterator[memoryview] | None = None,
                    term: int = 0) -> tuple[Any, Any]:
        """The table shard of a ``PushPullRowsRequest`` and its checked push and pull (the
        buffers from ``parts``, a framed batch's, when given)."""
        pull = request.pull
        push = request.push if request.HasField("push") else None
        if push is not None and (push.table, push.shard) != (pull.table, pull.shard):
            raise InvalidArgumentError(
                f"PushPullRows pushes to table {push.table!r} shard {push.shard} but pulls from "
                f"table {pull.table!r} shard {pull.shard}; one call serves one table shard."
            )
        if parts is None:
            ids, push_data = pull.ids, None
        else:
            ids = next(parts)
            push_data = None if push is None else (next(parts), next(parts))
        shard = self.table(pull.table, pull.shard, term)
        return shard, shard.check(push, ids, pull.num_ids, push_data)

    @staticmethod
    def _item_reply(shard: Any, pull: Any, outcome: Any, applied: int, rows: bytes = b"") -> Any:
        reply = tpb.PushPullRowsReply(pull=tpb.PullRowsReply(
            num_ids=pull.num_ids, dim=shard.store.dim,
            dtype=str(shard.dtype).removeprefix("torch."), rows=rows))
        if outcome is not None:
            reply.push.CopyFrom(tpb.PushRowsReply(status=outcome.status, message=outcome.message,
                                                  duplicate=outcome.duplicate, applied=applied))
        return reply

    @staticmethod
    def _each_request(handler: Any, requests: Iterator[bytes],
                      context: grpc.ServicerContext | None) -> Iterator[bytes]:
        """A stream of ``handler``'s calls: one reply per request, in order.

        A refused request ends the call with its status, as it ends a unary
        call; the worker then opens another stream.
        """
        for request in requests_until_closed(iter(requests)):
            yield handler(request, context)

    def push_pull_rows_stream(self, requests: Iterator[bytes],
                              context: grpc.ServicerContext | None = None) -> Iterator[bytes]:
        """Many ``PushPullRows`` on one long-lived call."""
        return self._each_request(self.push_pull_rows, requests, context)

    def row_batch(self, data: bytes, context: grpc.ServicerContext | None = None) -> bytes:
        """The ``PushPullRows`` of many table shards: every item checked, then each applied.

        A refused item (an unknown table, bad ids or values) refuses the call
        before anything is applied or read; a push refused when it is applied
        (a superseded incarnation) ends the call there (``tables.proto``).
        """
        from towerflow.ps.server.tables.shard import ROWS_REPLY_LIMIT

        head, payload = unpack(data)
        request = parse_message(tpb.RowBatchRequest, head, "RowBatch")
        if len(request.items) > MAX_BATCH_ITEMS:
            raise InvalidArgumentError(
                f"A RowBatch carries {len(request.items)} items, more than {MAX_BATCH_ITEMS}; "
                "send the tables in several calls."
            )
        wanted = sum(3 if item.HasField("push") else 1 for item in request.items) + request.dense
        if len(request.parts) != wanted:
            raise InvalidArgumentError(
                f"A RowBatch of {len(request.items)} items announces {len(request.parts)} "
                f"buffers, not {wanted}; client and ps must run the same towerflow version."
            )
        parts = iter(split_parts(payload, request.parts, "RowBatch"))
        checked = [self._check_item(item, parts, request.term) for item in request.items]
        reply_bytes = sum(item.pull.num_ids * shard.store.dim * shard.dtype.itemsize
                          for item, (shard, _) in zip(request.items, checked, strict=True))
        if reply_bytes > ROWS_REPLY_LIMIT:
            raise ResourceExhaustedError(
                f"A RowBatch pulls {reply_bytes / 2**20:,.0f} MiB of rows, more than "
                f"{ROWS_REPLY_LIMIT >> 20} MiB in one reply; send the tables in several calls."
            )
        active = _active(context)
        reply = tpb.RowBatchReply(dense=request.dense)
        out: list[bytes | memoryview] = []
        for item, (shard, ready) in zip(request.items, checked, strict=True):
            outcome, applied, rows = shard.run(ready, active)
            reply.items.append(self._item_reply(shard, item.pull, outcome, applied))
            out.append(raw_bytes(rows))
        self._forward(*(shard for item, (shard, _) in zip(request.items, checked, strict=True)
                        if item.HasField("push")))  # before any of it is answered
        if request.dense:  # the dense shard's push-and-pull of the same step, after the rows
            out.append(self._dense_step(next(parts), context))
        reply.parts.extend(len(part) for part in out)
        return pack_parts(reply.SerializeToString(), out)

    def _dense_step(self, request: memoryview, context: grpc.ServicerContext | None) -> bytes:
        if self.dense is None:
            raise FailedPreconditionError(
                f"ps task {self.task_index} serves tables but no dense shard here, so a RowBatch "
                "cannot carry a dense push; send it to the ps shard service (PushPullSmall)."
            )
        return self.dense.push_pull_small(request, context)

    def row_batch_stream(self, requests: Iterator[bytes],
                         context: grpc.ServicerContext | None = None) -> Iterator[bytes]:
        """Many ``RowBatch`` on one long-lived call (a worker's hot path)."""
        return self._each_request(self.row_batch, requests, context)

    def export_rows(self, data: bytes) -> Iterator[bytes]:
        request = parse_message(tpb.ExportRowsRequest, data, "ExportRows")
        shard = self.table(request.table, request.shard)
        chunk_rows = request.chunk_rows or DEFAULT_CHUNK_ROWS
        if not 0 < chunk_rows <= _MAX_CHUNK_ROWS:
            raise InvalidArgumentError(
                f"ExportRows chunk_rows={chunk_rows}; use 1 .. {_MAX_CHUNK_ROWS} (0: default)."
            )
        if request.id_start < 0 or request.id_stop < 0 or \
                (request.id_stop and request.id_stop < request.id_start):
            raise InvalidArgumentError(
                f"ExportRows of ids [{request.id_start}, {request.id_stop}): give 0 <= id_start "
                "<= id_stop (id_stop 0: every row)."
            )
        spec = tpb.TableSpec.FromString(shard.spec_bytes)
        first = True
        for piece, total, pushes in shard.chunks(chunk_rows, request.id_start,
                                                 request.id_stop or None):
            names = list(piece.slots)
            chunk = tpb.RowChunk(
                num_ids=piece.ids.numel(), ids=encode(piece.ids), rows=encode(piece.rows),
                slot_names=names, slots=[encode(piece.slots[k]) for k in names])
            if piece.versions is not None:
                chunk.versions = encode(piece.versions)
            if piece.counters is not None and piece.counters[0].numel():
                chunk.num_counters = piece.counters[0].numel()
                chunk.counter_ids, chunk.counter_counts = map(encode, piece.counters)
            if first:
                chunk.spec.CopyFrom(spec)
                chunk.total = total
                chunk.pushes.extend(push_records(pushes))
                first = False
            yield chunk.SerializeToString()

    def import_rows(self, chunks: Iterator[bytes]) -> bytes:
        parsed = [parse_message(tpb.RowChunk, data, "ImportRows") for data in chunks]
        if not parsed:
            raise InvalidArgumentError(
                "ImportRows got no chunk; the first names the table and shard in spec."
            )
        spec = parsed[0].spec
        shard = self.table(spec.name, spec.shard)
        rows = shard.import_chunks(parsed)
        self._forward(shard)
        return tpb.ImportRowsReply(rows=rows).SerializeToString()

    def table_status(self, data: bytes) -> bytes:
        request = parse_message(tpb.TableStatusRequest, data, "TableStatus")
        shard = self.table(request.table, request.shard)
        status = shard.status()
        reply = tpb.TableStatusReply(rows=status["rows"], nbytes=status["nbytes"],
                                     applied=status["applied"],
                                     pulled_rows=status["pulled_rows"],
                                     sync_step=status["sync_step"], max_lead=status["max_lead"],
                                     admitted=status.get("admitted", 0),
                                     evicted=status.get("evicted", 0),
                                     filtered=status.get("filtered", 0))
        reply.spec.CopyFrom(tpb.TableSpec.FromString(shard.spec_bytes))
        reply.pushes.extend(push_records(status["pushes"]))
        return reply.SerializeToString()


    def table_stats(self, data: bytes) -> bytes:
        """One ``TableShardStats`` per table shard held here, by name and shard."""
        parse_message(tpb.TableStatsRequest, data, "TableStats")
        with self._lock:
            held = sorted(self._tables.items())
        reply = tpb.TableStatsReply()
        for (name, index), shard in held:
            status = shard.status()
            reply.tables.add(name=name, shard=index, kind=shard.description["kind"],
                             rows=status["rows"], nbytes=status["nbytes"],
                             applied=status["applied"], admitted=status.get("admitted", 0),
                             evicted=status.get("evicted", 0),
                             filtered=status.get("filtered", 0))
        return reply.SerializeToString()


class TableHost:
    """The table service as a ps task ``Server``'s hosted service (``JOB_SERVICES["ps"]``).

    Args:
        server: the ps task's server (not started yet).
    """

    __slots__ = ("server", "service")

    def __init__(self, server: Any) -> None:
        self.server = server
        self.service = TableService(server.task.task_index,
                                    peer_channel=lambda k: server.channel("ps", k),
                                    num_ps=len(server.cluster.job_tasks("ps")))

    def handlers(self) -> Any:
        """The ``towerflow.ps.Tables`` gRPC service."""
        return self.service.handlers()

    def start(self) -> None:
        """Nothing to start: tables are created by ``InitTable`` (the task's ``ShardHost``
        puts the service beside its dense shard: :meth:`TableService.serve_beside`)."""

    def stop(self) -> None:
        """Nothing to stop."""

    def __repr__(self) -> str:
        return f"TableHost(ps task {self.service.task_index})"
