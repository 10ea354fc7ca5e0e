"""A fixed table shard's live copy on the next ps task: the primary's side.

With ``replicas=1`` (the chief's ``AggregationConfig``, in ``InitTableRequest.aggregation``)
table shard ``i`` has a copy on ps task ``(i + 1) % n``, kept as the dense shard's is
(:mod:`towerflow.ps.server.dense.replication`), under the same term per shard:

- the copy's table is made as the primary's (``ReplicaInitTable``, the same
  ``InitTableRequest``), then every row is copied with its slots;
- a push marks the rows it changed (:meth:`RowReplica.mark`, under the shard's
  lock); before the push is answered the changed rows, with their optimizer
  slots and the shard's push table, read under the shard's lock (so a push is
  in both or in neither), travel as an import's chunks (``ReplicateRows``,
  ``RowChunk``), the applied values, not the gradients; pushes that finish
  together share one copy (:class:`~towerflow.ps.server.terms.GroupCommit`);
- a copy that did not reach the replica leaves its rows marked (the next copy
  carries them), and its push unanswered (``UNAVAILABLE``); a replica that took
  the shard over refuses the copy and deposes this task; one that has no copy
  (restarted) gets the table and every row again.

A dynamic table's copy is kept the same way: a push's copy carries the rows it changed
with their versions, and the ids that have no row on the primary (evicted by age or
capacity, or not admitted yet) with their admission counters, which the replica drops and
sets in turn (:meth:`~towerflow.ps.server.tables.dynamic.DynamicRowStore.export_changed`);
its whole copy is made on a table made again, part by part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError, UnavailableError
from towerflow.ps.server.terms import (
    REPLICA,
    REPLICA_TIMEOUT,
    CopyStream,
    GroupCommit,
    ShardTerm,
    deposed,
    send_copy,
)
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.messages import parse_message, push_records
from towerflow.ps.wire.tables import describe_table_spec
from towerflow.ps.wire.tensors import encode

__all__ = ["RowReplica", "TableCopies", "COPY_CHUNK_ROWS"]

#: rows per chunk of a copy
COPY_CHUNK_ROWS = 1 << 14


class RowReplica:
    """The primary's side of one table shard's copy (see the module doc).

    Args:
        shard: the primary's :class:`~towerflow.ps.server.tables.shard.TableShard`.
        term: the shard's term on this task.
        replica_task: the ps task holding the copy.
        channel: ``channel()`` -> an authenticated channel to ``replica_task``.
        init_request: the ``InitTableRequest`` bytes the table was made from.
        path: ``path(method)`` -> the full path of a ``Tables`` method.
        timeout: seconds to wait for the replica's acknowledgement.
    """

    def __init__(self, shard: Any, term: ShardTerm, replica_task: int,
                 channel: Callable[[], Any], init_request: bytes, path: Callable[[str], str],
                 timeout: float = REPLICA_TIMEOUT) -> None:
        self.shard, self.term, self.replica_task = shard, term, replica_task
        self._channel, self._init, self._path, self.timeout = channel, init_request, path, timeout
        self._dirty: list[torch.Tensor] = []
        self._whole = True  # every row, at first
        self._catching = False  # a catch-up runs: rows are marked though the shard is alone
        self._made = False
        self._sent: list | None = None  # the push table the replica last acknowledged
        self._commit = GroupCommit(self._send)
        self._stream = CopyStream(channel, path("ReplicateRowsStream"), term, replica_task,
                                  timeout)

    def mark(self, ids: torch.Tensor) -> None:
        """Rows ``ids`` changed (the shard's lock held): the next copy carries them (none
        kept while the shard is served alone: its catch-up copies every row)."""
        if self._whole:
            return
        if self.term.alone and not self._catching:
            self._keep(False)
            return
        self._dirty.append(ids.clone())

    @property
    def _dynamic(self) -> bool:
        return hasattr(self.shard.store, "export_changed")

    def _keep(self, changes: bool) -> None:
        """Keep the changed rows for the next copy from now on, or (False) copy them all
        next (the shard's lock held)."""
        self._whole, self._dirty = not changes, []
        if self._dynamic:  # its evictions too
            self.shard.store.noted = [] if changes else None

    def forward(self) -> None:
        """Return once the replica holds the shard's changed rows and push table as they are
        now (pushes that ask together share one copy).

        Raises:
            UnavailableError: the replica did not acknowledge within the timeout.
            FailedPreconditionError: the replica took the shard over: this task is deposed.
        """
        if not self.term.alone:  # alone: its replica's task is gone (ShardTerm.go_alone)
            self._catching = False
            self._commit.wait()

    def _send(self) -> None:

        for _ in range(2):  # once more after making the table on a restarted replica
            if not self._made:
                self._make()
            if self._whole:
                reply = self._send_whole()
            else:
                chunks, taken, records = self._take()
                if chunks is None:
                    return  # nothing changed since the replica's last acknowledgement
                try:
                    data = self._stream.call(chunks[0]) if len(chunks) == 1 else \
                        send_copy(self._channel(), self._path("ReplicateRows"), chunks,
                                  self.term, self.replica_task, self.timeout)
                except BaseException:
                    self._give_back(taken)
                    raise
                reply = parse_message(pb.ReplicateReply, data, "ReplicateReply")
                if reply.accepted:
                    self._sent = records
            if reply.accepted:
                return
            self._give_back(None)
            self._sent = None
            if reply.term:
                raise deposed(self.term, reply, self.replica_task)
            self._made = False  # the replica holds no copy (restarted): it rejoins (a catch-up)
            self.term.go_alone()
            return
        raise deposed(self.term, reply, self.replica_task)

    def _make(self, catch_up: bool = False) -> None:
        """Make the table on the replica's task (at this primary's term; ``catch_up``: its
        copy is not promoted until the primary says it caught up)."""
        from towerflow.cluster.transport import unary

        request = tpb.InitTableRequest.FromString(self._init)
        request.term, request.catch_up = self.term.term, catch_up
        unary(self._channel(), self._path("ReplicaInitTable"), request.SerializeToString(),
              timeout=self.timeout)
        self._made = True

    def catch_up(self) -> None:
        """Copy the whole shard to a replica that rejoined while this primary serves it alone:
        the table, then every row and its slots in parts of :data:`COPY_CHUNK_ROWS` rows, each
        read under the shard's lock while pushes go on between them (neither side holds a
        second copy of the shard); then the rows those pushes changed. The caller ends the
        shard's alone time (:meth:`~towerflow.ps.server.terms.ShardTerm.joined`) once every
        copy of the shard caught up; pushes answered before then are marked, and carried by
        the next copy.

        Raises:
            UnavailableError: the replica did not acknowledge a part within the timeout.
            FailedPreconditionError: the replica refused (it serves the shard at a newer term).
        """
        shard = self.shard
        with self._commit.alone():
            self._make(catch_up=True)
            with shard.cond:
                self._keep(True)
                self._sent, self._catching = None, True
        try:
            for chunk in self._parts():
                with self._commit.alone():
                    reply = parse_message(pb.ReplicateReply, self._stream.call(chunk),
                                          "ReplicateReply")
                if not reply.accepted and reply.term:
                    raise deposed(self.term, reply, self.replica_task)
                if not reply.accepted:  # restarted again meanwhile: the next catch-up
                    raise UnavailableError(
                        f"ps task {self.replica_task} lost the copy of table "
                        f"{shard.name!r} shard {shard.shard} during its catch-up "
                        f"({reply.message}); it is copied again once it answers.")
            self._commit.wait()  # the rows pushed meanwhile
        except BaseException:
            with shard.cond:
                self._keep(False)
                self._catching = False
            raise

    def _parts(self) -> Iterator[bytes]:
        """The whole shard as copy chunks of :data:`COPY_CHUNK_ROWS` rows, each read under
        the shard's lock in turn (pushes go on between them); a dynamic table's first
        carries its admission counters (its evictions wait until the last)."""
        shard, term = self.shard, self.term.term
        if self._dynamic:
            for piece, _, _ in shard.chunks(COPY_CHUNK_ROWS):
                with shard.cond:
                    records = shard.live_records()
                yield from _chunks(piece, records, term, shard, counters=piece.counters)
            return
        owned = shard.store.partitioner.global_ids(shard.store.shard)
        for start in range(0, max(owned.numel(), 1), COPY_CHUNK_ROWS):
            with shard.cond:
                records = shard.live_records()
                part = shard.store.export_ids(owned[start:start + COPY_CHUNK_ROWS])
            yield from _chunks(part, records, term, shard)

    def _send_whole(self) -> Any:
        """Every row and its slots, in parts of :data:`COPY_CHUNK_ROWS` rows, one call each
        (the replica sets each as it comes: neither side holds a second copy of the shard),
        the shard's lock held throughout so that no push falls between two parts; the push
        table with every part. The replica's reply (the last, or the first refusal). A
        dynamic table is made again on the replica (its evicted rows go), then copied part
        by part with pushes between them (marked for the next copy), as a catch-up is."""
        shard, reply = self.shard, None
        if self._dynamic:
            self._make()
            with shard.cond:
                self._keep(True)
                self._sent = None
            try:
                for chunk in self._parts():
                    reply = parse_message(pb.ReplicateReply, self._stream.call(chunk),
                                          "ReplicateReply")
                    if not reply.accepted:
                        return reply
            except BaseException:
                with shard.cond:
                    self._keep(False)
                raise
            return reply
        with shard.cond:
            records = shard.live_records()
            owned = shard.store.partitioner.global_ids(shard.store.shard)
            try:
                for start in range(0, max(owned.numel(), 1), COPY_CHUNK_ROWS):
                    part = shard.store.export_ids(owned[start:start + COPY_CHUNK_ROWS])
                    (chunk,) = _chunks(part, records, self.term.term, shard)
                    reply = parse_message(pb.ReplicateReply, self._stream.call(chunk),
                                          "ReplicateReply")
                    if not reply.accepted:
                        return reply
            except BaseException:
                self._whole, self._dirty = True, []
                raise
            self._whole, self._dirty, self._sent = False, [], records
        return reply

    def _take(self) -> tuple[list[bytes] | None, torch.Tensor | None, list]:
        """The copy's chunks of the rows changed since the last one (read under the shard's
        lock; None: nothing changed), their ids and the push table."""
        shard = self.shard
        with shard.cond:
            records = shard.live_records()
            dirty = self._dirty
            if not dirty and records == self._sent:
                return None, None, records
            self._dirty = []
            if self._dynamic:  # the rows it evicted meanwhile too
                dirty += shard.store.noted or []
                shard.store.noted = []
            ids = torch.unique(torch.cat(dirty)) if dirty else torch.empty(0, dtype=torch.int64)
            if not self._dynamic:
                export, dropped, counters = shard.store.export_ids(ids), None, None
            else:
                export, dropped, counters = shard.store.export_changed(ids)
        return list(_chunks(export, records, self.term.term, shard, dropped=dropped,
                            counters=counters)), ids, records

    def _give_back(self, ids: torch.Tensor | None) -> None:
        """A copy that did not land: its rows are marked again (None: every row)."""
        with self.shard.cond:
            if ids is None:
                self._keep(False)
            elif not self._whole:
                self._dirty.append(ids)


def _chunks(export: Any, records: list, term: int, shard: Any, *,
            dropped: torch.Tensor | None = None,
            counters: tuple[torch.Tensor, torch.Tensor] | None = None) -> Iterator[bytes]:
    """``export`` as ``RowChunk`` messages of :data:`COPY_CHUNK_ROWS` rows (a dynamic
    table's with their versions); the first names the table shard, its term and its push
    table, and carries a dynamic table's ``dropped`` ids and admission ``counters``."""
    total = export.ids.numel()
    names = list(export.slots)
    for start in range(0, max(total, 1), COPY_CHUNK_ROWS):
        stop = min(start + COPY_CHUNK_ROWS, total)
        chunk = tpb.RowChunk(num_ids=stop - start, ids=encode(export.ids[start:stop]),
                             rows=encode(export.rows[start:stop]), slot_names=names,
                             slots=[encode(export.slots[k][start:stop]) for k in names])
        if export.versions is not None:
            chunk.versions = encode(export.versions[start:stop])
        if start == 0:
            chunk.spec.CopyFrom(tpb.TableSpec.FromString(shard.spec_bytes))
            chunk.total, chunk.term = total, term
            chunk.pushes.extend(push_records(records))
            if dropped is not None and dropped.numel():
                chunk.num_dropped, chunk.dropped = dropped.numel(), encode(dropped)
            if counters is not None and counters[0].numel():
                chunk.num_counters = counters[0].numel()
                chunk.counter_ids, chunk.counter_counts = map(encode, counters)
        yield chunk.SerializeToString()


class TableCopies:
    """The copies of other ps tasks' table shards one ps task holds (the replica's side).

    Args:
        terms: the task's shard terms (a copy's, ``replica`` until promoted).
        make: ``make(spec, aggregation)`` -> a new table shard as ``InitTable`` makes one.
    """

    def __init__(self, terms: Any, make: Callable[[Any, Any], Any]) -> None:
        self.terms, self._make = terms, make
        self._copies: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str, shard: int) -> Any | None:
        """The copy of table ``name``'s shard ``shard`` held here, or None."""
        return self._copies.get((name, shard))

    def of_shard(self, shard: int | None) -> list[Any]:
        """The copies of the table shards of index ``shard`` (None: all) held here."""
        with self._lock:
            return [copy for (_, s), copy in self._copies.items() if shard in (None, s)]

    def init_table(self, request: Any, aggregation: Any) -> Any:
        """``ReplicaInitTable``: make the copy of the table shard ``request`` describes (the
        same one again: kept); return it."""
        spec = request.spec
        term = self.terms.of(spec.shard, REPLICA)
        with self._lock:
            held = self._copies.get((spec.name, spec.shard))
            description = describe_table_spec(spec)
            if held is None or term.role == REPLICA and (  # a dynamic copy: made again whole
                    description["kind"] != "dense" or not held.same_table(description,
                                                                          aggregation)):
                held = self._copies[(spec.name, spec.shard)] = self._make(spec, aggregation)
            return held

    def replicate(self, chunks: Iterator[bytes]) -> bytes:
        """``ReplicateRows``: take a primary's changed rows, slots and push table."""
        parsed = [parse_message(tpb.RowChunk, data, "ReplicateRows") for data in chunks]
        if not parsed:
            raise InvalidArgumentError("ReplicateRows got no chunk; the first names the shard.")
        first = parsed[0]
        copy = self._copies.get((first.spec.name, first.spec.shard))
        if copy is None:
            return pb.ReplicateReply(accepted=False, term=0, message=(
                f"no copy of table {first.spec.name!r} shard {first.spec.shard} here"
            )).SerializeToString()
        term = self.terms.of(first.spec.shard, REPLICA)
        with term.copying(first.term) as refusal:
            if refusal:
                return pb.ReplicateReply(accepted=False, term=term.term,
                                         message=refusal).SerializeToString()
            copy.import_chunks(parsed)
        return pb.ReplicateReply(accepted=True, term=term.term).SerializeToString()
