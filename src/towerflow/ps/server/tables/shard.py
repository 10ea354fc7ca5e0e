"""One shard of one sparse table on a ps task: its rows, its lock, its push table.

A :class:`TableShard` wraps a :class:`~towerflow.ps.server.tables.rows.RowStore` for the
``towerflow.ps.Tables`` service (:mod:`towerflow.ps.server.tables.service`). It owns
its lock and its counters; nothing else reaches into them:

- a pull decodes and checks the ids outside the lock, then gathers the rows
  under it (``index_select``: a copy of one moment);
- a push decodes and checks everything outside the lock (ids owned by this
  shard, in the table, values finite, of the table's dtype, ``lr`` and
  ``step`` valid), then, under the lock, classifies it in the shard's own
  :class:`~towerflow.ps.server.pushes.PushTable` (a retry of an applied push is
  answered, not applied again; a superseded incarnation is refused), refuses
  a new one from an id that is not one of the job's current workers, and
  hands it to the job's aggregation mode
  (:mod:`towerflow.ps.server.tables.aggregation`: async applies it at once, sync
  counts it in its step, ssp applies it and waits for the slowest worker),
  which records its answer;
- an export copies rows, slots and the push table under the lock (one moment)
  and is cut into chunks outside it; a dynamic table's lists its ids (sorted,
  with their slots: 16 bytes a row) under the lock and reads each chunk's
  rows, slots and versions under it in turn, so no copy of the whole shard
  is made (each chunk is of one moment, its rows with their slots);
- an import checks every chunk before it sets any row;
- the push records are the job's current workers' only
  (:mod:`towerflow.ps.server.tables.records`): those of a former worker are
  dropped, so a status, an export and an import carry the live ones.

Buffers arrive as raw little-endian bytes (int64 ids, rows in the table's
dtype) and are read in place (:func:`~towerflow.ps.wire.tensors.decode`: a
view of the received message's bytes, no copy); a refusal names the value and leaves the shard as
it was. A push-and-pull (``PushPullRows``) is a push and a pull under one
hold of the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from towerflow.cluster.options import DEFAULT_MAX_MESSAGE_BYTES
from towerflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from towerflow.ps.server.pushes import MAX_REPLICAS_TRACKED, PushHeader, PushOutcome
from towerflow.ps.server.tables.aggregation import make_row_aggregator
from towerflow.ps.server.tables.records import MAX_PUSHES_IN_FLIGHT, JobWorkers, TablePushes
from towerflow.ps.server.tables.rows import RowExport, RowStore
from towerflow.ps.server.tables.stores import row_store_from_dict
from towerflow.ps.spec.tables import DTYPES_BY_NAME
from towerflow.ps.wire.messages import push_rows
from towerflow.ps.wire.tables import describe_table_spec
from towerflow.ps.wire.tensors import decode, encode

__all__ = ["TableShard"]


#: largest rows reply a shard builds: a gRPC message, less room for its header
ROWS_REPLY_LIMIT = DEFAULT_MAX_MESSAGE_BYTES - (1 << 20)


class TableShard:
    """A table shard behind the service (see the module docstring).

    Args:
        spec: the ``TableSpec`` message it was created from.
        aggregation: the table's ``AggregationConfig`` (None: async).
        workers: the job's current workers, whose pushes it takes and keeps
            records of (:mod:`~towerflow.ps.server.tables.records`; None: any id).

    Raises:
        InvalidArgumentError: what :func:`~towerflow.ps.wire.tables.describe_table_spec` or the row store refuses.
    """

    def __init__(self, spec: Any, aggregation: Any = None,
                 workers: JobWorkers | None = None) -> None:
        self.description = describe_table_spec(spec)
        self.name = spec.name
        self.spec_bytes = spec.SerializeToString(deterministic=True)
        self.store: RowStore = row_store_from_dict(self.description)
        self.dtype = self.store.dtype
        self.aggregation = aggregation
        self._lock = threading.Lock()
        self.cond = threading.Condition(self._lock)
        self._pushes = TablePushes()
        self._applied = 0
        self._pulled_rows = 0
        self._mode = make_row_aggregator(self, aggregation, workers)
        #: the primary's side of this shard's copy on the next ps task (replicas=1), or None
        self.replica: Any = None

    @property
    def shard(self) -> int:
        """This shard's index under the table's partitioner."""
        return self.store.shard

    def _ids(self, data: bytes, count: int) -> torch.Tensor:
        ids = decode(data, torch.int64, count, f"Table {self.name!r} ids")
        try:
            self.store.partitioner.local_index(ids, self.shard)  # range, sign, ownership
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"Table {self.name!r} shard {self.shard}: {exc}") from None
        return ids

    def _pull_ids(self, data: bytes, count: int) -> torch.Tensor:
        """The ids of a pull, once its reply is known to fit a message.

        Raises:
            ResourceExhaustedError: the reply would exceed :data:`ROWS_REPLY_LIMIT`
                (checked before any id is decoded or row read).
        """
        nbytes = count * self.store.dim * self.dtype.itemsize
        if nbytes > ROWS_REPLY_LIMIT:
            raise ResourceExhaustedError(
                f"Table {self.name!r}: a pull of {count:,} rows x {self.store.dim} needs a "
                f"{nbytes / 2**20:,.0f} MiB reply, more than {ROWS_REPLY_LIMIT >> 20} MiB; pull "
                "fewer ids per call (smaller batches)."
            )
        return self._ids(data, count)

    def _values(self, data: bytes, dtype: str, ids: torch.Tensor, what: str) -> torch.Tensor:
        if DTYPES_BY_NAME.get(dtype) != self.dtype:
            raise InvalidArgumentError(
                f"Table {self.name!r} holds {str(self.dtype).removeprefix('torch.')} rows but "
                f"the {what} are {dtype!r}; send them as the table's dtype."
            )
        dim = self.store.dim
        values = decode(data, self.dtype, ids.numel() * dim, f"Table {self.name!r} {what}")
        values = values.view(ids.numel(), dim)
        if values.numel() and not bool(torch.isfinite(values.sum())):
            finite = torch.isfinite(values).all(dim=1)
            if not bool(finite.all()):
                pos = int((~finite).nonzero()[0, 0])
                raise InvalidArgumentError(
                    f"Table {self.name!r}: the {what} of id {int(ids[pos])} hold "
                    f"{values[pos].tolist()[:8]}, not finite; nothing was applied. Find where "
                    "the NaN or infinity comes from (lower the learning rate or clip gradients)."
                )
        return values

    # -- calls -----------------------------------------------------------------------------
    def pull(self, data: bytes, count: int) -> bytes:
        """The rows of the ids in ``data``, as raw bytes in the order asked."""
        ids = self._pull_ids(data, count)
        with self._lock:
            rows = self.store.lookup(ids, checked=True)
            self._pulled_rows += ids.numel()
        return encode(rows)

    def push(self, request: Any, active: Callable[[], bool] | None = None
             ) -> tuple[PushOutcome, int]:
        """Apply a ``PushRowsRequest`` once; return its outcome and the updates applied.

        ``active()`` (the call's ``is_active``) ends a sync / ssp wait of a
        push whose call has ended.
        """
        checked = self._check_push(request)
        with self.cond:
            return self._apply_once(*checked, active)

    def push_pull(self, push: Any | None, data: bytes, count: int,
                  active: Callable[[], bool] | None = None
                  ) -> tuple[PushOutcome | None, int, torch.Tensor]:
        """Apply ``push`` (a ``PushRowsRequest`` or None) once, then read the rows of ``data``.

        Everything is checked before the lock is taken (a refused push refuses
        the call: nothing applied, nothing read); the rows are read after the
        push is applied (in sync mode, after its step), so they include it.
        Returns the push's outcome (None without a push), the updates
        applied, the rows (a new tensor).
        """
        return self.run(self.check(push, data, count), active)

    def check(self, push: Any | None, data: bytes | memoryview, count: int,
              push_data: tuple[memoryview, memoryview] | None = None
              ) -> tuple[Any, torch.Tensor]:
        """:meth:`push_pull`'s checks, outside the lock: what :meth:`run` then applies and reads.

        A batch of many table shards (``RowBatch``) checks every item before it
        runs any; its push's ids and gradients come as ``push_data`` (views of
        the framed request), not in the ``PushRowsRequest``.
        """
        return (None if push is None else self._check_push(push, push_data)), \
            self._pull_ids(data, count)

    def run(self, checked: tuple[Any, torch.Tensor], active: Callable[[], bool] | None = None
            ) -> tuple[PushOutcome | None, int, torch.Tensor]:
        """Apply a :meth:`check`-ed push once, then read its pull's rows (one hold of the lock)."""
        push, ids = checked
        with self.cond:
            outcome, applied = (None, self._applied) if push is None else \
                self._apply_once(*push, active)
            rows = self.store.lookup(ids, checked=True)
            self._pulled_rows += ids.numel()
        return outcome, applied, rows

    def _check_push(self, request: Any, data: tuple[memoryview, memoryview] | None = None
                    ) -> tuple[PushHeader, torch.Tensor, torch.Tensor, float, int]:
        """Everything a push needs checked, outside the lock: header, ids, grads, lr, step
        (the ids and gradients from ``data`` when given, else from the request)."""
        if request.worker_id < 0 or request.seq < 1:
            raise InvalidArgumentError(
                f"Table {self.name!r}: a push needs worker_id >= 0 and seq >= 1, got "
                f"worker_id={request.worker_id}, seq={request.seq}."
            )
        ids_data, grads_data = (request.ids, request.grads) if data is None else data
        ids = self._ids(ids_data, request.num_ids)
        grads = self._values(grads_data, request.dtype, ids, "row gradients")
        try:
            lr, step = self.store.optimizer.check_step(request.lr, request.step)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"Table {self.name!r}: {exc}") from None
        header = PushHeader(worker_id=request.worker_id, seq=request.seq, token=0, lr=lr,
                            numel=grads.numel(), incarnation=request.incarnation)
        return header, ids, grads, lr, step

    def _apply_once(self, header: PushHeader, ids: torch.Tensor, grads: torch.Tensor,
                    lr: float, step: int, active: Callable[[], bool] | None
                    ) -> tuple[PushOutcome, int]:
        """Classify a checked push and hand a new one to the mode; the caller holds ``cond``.

        A retry of a push already answered gets its answer again; a retry of a
        sync push still waiting for its step waits for the same answer.
        """
        look = self._pushes.lookup(header, self._applied)
        if look.kind in ("superseded", "refused"):
            raise FailedPreconditionError(f"Table {self.name!r}: {look.message}")
        if look.kind in ("done", "pending"):
            outcome = look.outcome if look.kind == "done" else \
                self._mode.wait(header, look.pending, active)
            return PushOutcome(outcome.status, outcome.step, outcome.message, True), \
                self._applied
        self._mode.check(header.worker_id)
        self._make_room(header)
        self.store.observe(ids)  # a dynamic table's admission counts each push once
        pending, _ = self._pushes.register(header)  # row pushes are never suspended
        try:
            outcome = self._mode.accept(header, pending, ids, grads, lr, step, active)
        except DeadlineExceededError:
            raise  # counted in its sync step, or applied (ssp): its retry is answered
        except BaseException:
            self._pushes.drop(header)
            raise
        return outcome, self._applied

    def _make_room(self, header: PushHeader) -> None:
        """Before a new push is recorded (``cond`` held): a new worker id's first push drops
        the records of former workers; a worker's pushes in progress are bounded.

        Raises:
            ResourceExhaustedError: the worker has :data:`MAX_PUSHES_IN_FLIGHT` in progress.
        """
        worker = header.worker_id
        if worker not in self._pushes:
            self._prune()
            return
        held = self._pushes.in_flight(worker, header.incarnation)
        if held >= MAX_PUSHES_IN_FLIGHT:
            raise ResourceExhaustedError(
                f"Table {self.name!r}: push {header.seq} of worker {worker} was refused: it has "
                f"{held} pushes in progress on shard {self.shard}, the most one worker may "
                "have; send the next once one of them is answered."
            )

    def _prune(self) -> None:
        """Drop the push records of former workers (``cond`` held)."""
        if self._mode.knows_job():
            self._pushes.prune(self._mode.current)

    def live_records(self) -> list[tuple[int, int, int, str]]:
        """The push records of the job's current workers (``cond`` held): the others dropped."""
        self._prune()
        return self._pushes.rows()

    _live_records = live_records

    def apply_rows(self, ids: torch.Tensor, grads: torch.Tensor, lr: float, step: int, *,
                   checked: bool = False) -> int:
        """Apply one update to the rows (``cond`` held); the updates applied so far.

        ``checked=True``: ids, gradients, ``lr`` and ``step`` are a push's, checked
        by this shard (not checked again under the lock).
        """
        self.store.apply(ids, grads, lr, step, checked=checked)
        self._applied += 1
        if self.replica is not None:
            self.replica.mark(ids)
        return self._applied

    def settle(self, header: PushHeader, outcome: PushOutcome) -> None:
        """Record ``header``'s push's answer in the push table (``cond`` held)."""
        self._pushes.settle(header, outcome)

    def worker_done(self, worker_id: int) -> None:
        """Worker ``worker_id`` has finished: sync steps and the ssp bound stop waiting for it."""
        with self.cond:
            self._mode.worker_done(worker_id)
            self._prune()  # an elastic worker's record, once its Done retired it

    def snapshot(self, start: int = 0, stop: int | None = None
                 ) -> tuple[RowExport, list[tuple[int, int, int, str]]]:
        """Rows, slots and push table of one moment (copies; the ids in ``[start, stop)``)."""
        with self._lock:
            return self.store.export(start, stop), self._live_records()

    def chunks(self, chunk_rows: int, start: int = 0, stop: int | None = None
               ) -> Iterator[tuple[RowExport, int, list]]:
        """The export (of the ids in ``[start, stop)``) in pieces of ``chunk_rows`` rows:
        ``(piece, total, push rows)``."""
        if hasattr(self.store, "begin_export"):
            yield from self._dynamic_chunks(chunk_rows)
            return
        export, pushes = self.snapshot(start, stop)
        total = export.ids.numel()
        for start in range(0, max(total, 1), chunk_rows):
            stop = min(start + chunk_rows, total)
            piece = RowExport(export.ids[start:stop], export.rows[start:stop],
                              {k: v[start:stop] for k, v in export.slots.items()})
            yield piece, total, pushes if start == 0 else []

    def _dynamic_chunks(self, chunk_rows: int) -> Iterator[tuple[RowExport, int, list]]:
        """A dynamic table's export: the ids of one moment (sorted, with their slots; no row
        copied), then each piece's rows, slots and versions read under the lock in turn
        (eviction waits until the export ends, so the slots stay their ids')."""
        store: Any = self.store
        with self._lock:
            plan = store.begin_export()
            pushes = self._live_records()
            counters = store.export_counters()
        try:
            total = plan[0].numel()
            for start in range(0, max(total, 1), chunk_rows):
                with self._lock:
                    piece = store.export_piece(plan, start, start + chunk_rows)
                if start == 0:  # the first chunk carries the admission counters
                    piece = piece._replace(counters=counters)
                yield piece, total, pushes if start == 0 else []
        finally:
            with self._lock:
                store.end_export()

    def import_chunks(self, chunks: Sequence[Any]) -> int:
        """Set the rows (and slots) of every ``RowChunk``; all checked before any is set. A
        dynamic table's copy from its primary (chunks naming a term) drops the rows and
        counters of the ids the chunks list as dropped, and its counters of the ids whose
        rows they carry, first (the primary's counters of those ids come with the chunks)."""
        parts, counters, dropped = [], [], []
        for chunk in chunks:
            if chunk.num_counters:
                counters.append(self._counters(chunk))
            if chunk.num_dropped:
                dropped.append(self._ids(chunk.dropped, chunk.num_dropped))
            ids = self._ids(chunk.ids, chunk.num_ids)
            rows = self._values(chunk.rows, str(self.dtype).removeprefix("torch."), ids, "rows")
            slots = None
            if chunk.slot_names:
                if len(chunk.slot_names) != len(chunk.slots):
                    raise InvalidArgumentError(
                        f"Table {self.name!r}: a chunk names {len(chunk.slot_names)} slots but "
                        f"carries {len(chunk.slots)}."
                    )
                slots = {name: self._values(data, str(self.dtype).removeprefix("torch."), ids,
                                            f"slot {name!r}")
                         for name, data in zip(chunk.slot_names, chunk.slots, strict=True)}
            versions = decode(chunk.versions, torch.int64, ids.numel(),
                              f"Table {self.name!r} versions") if chunk.versions else None
            parts.append((ids, rows, slots, versions))
        if not parts:
            return 0
        if len({p[2] is None for p in parts}) > 1:
            raise InvalidArgumentError(
                f"Table {self.name!r}: some chunks carry slots and some do not; send slots "
                "with every chunk or with none."
            )
        ids = torch.cat([p[0] for p in parts])
        rows = torch.cat([p[1] for p in parts])
        slots = None if parts[0][2] is None else {
            k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
        versions = None
        if any(p[3] is not None for p in parts):
            if not all(p[3] is not None or not p[0].numel() for p in parts):
                raise InvalidArgumentError(
                    f"Table {self.name!r}: some chunks carry row versions and some do not; "
                    "send them with every chunk or with none."
                )
            versions = torch.cat([p[3] if p[3] is not None else torch.empty(0, dtype=torch.int64)
                                  for p in parts])
        records = getattr(chunks[0], "pushes", ())
        if len(records) > MAX_REPLICAS_TRACKED:
            raise InvalidArgumentError(
                f"Table {self.name!r}: an import carries {len(records):,} push records, more than "
                f"the {MAX_REPLICAS_TRACKED} worker ids a shard keeps; nothing was imported. "
                "Import a checkpoint written by towerflow."
            )
        current = self._mode.current  # a record of a former worker is not taken in
        pushes = [row for row in push_rows(records) if current(row[0])]
        with self._lock:
            if chunks[0].term and hasattr(self.store, "forget"):  # a copy of a dynamic table
                for gone in dropped:
                    self.store.forget(gone, rows=True)
                self.store.forget(ids, rows=False)
            if versions is None:  # checks every value before any change
                self.store.import_(ids, rows, slots)
            else:
                self.store.import_(ids, rows, slots, versions)  # type: ignore[call-arg]
            for counter_ids, counts in counters:  # checked above
                self.store.import_counters(counter_ids, counts)  # type: ignore[attr-defined]
            self._pushes.merge(pushes, self._applied)
            self._prune()
            if self.replica is not None:
                self.replica.mark(ids)
        return ids.numel()

    def _counters(self, chunk: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's admission counters (ids owned here, counts >= 0), checked."""
        if not hasattr(self.store, "import_counters"):
            raise InvalidArgumentError(
                f"Table {self.name!r} is a fixed table; it keeps no admission counters (the "
                "chunk is of a dynamic table's export)."
            )
        ids = self._ids(chunk.counter_ids, chunk.num_counters)
        counts = decode(chunk.counter_counts, torch.int64, chunk.num_counters,
                        f"Table {self.name!r} admission counts")
        if counts.numel() and int(counts.min()) < 0:
            raise InvalidArgumentError(
                f"Table {self.name!r}: an admission count is {int(counts.min())}, below 0; "
                "import a checkpoint written by towerflow."
            )
        return ids, counts

    def status(self) -> dict[str, Any]:
        """Counters and the push table (its live records)."""
        with self._lock:
            return {"rows": self.store.num_rows, "nbytes": self.store.nbytes,
                    "applied": self._applied, "pulled_rows": self._pulled_rows,
                    "pushes": self._live_records(), "sync_step": self._mode.sync_step,
                    "max_lead": self._mode.max_lead,
                    **getattr(self.store, "counters", {})}

    def same_table(self, description: Mapping[str, Any], aggregation: Any = None) -> bool:
        """Whether ``description`` and ``aggregation`` describe this table shard."""
        return dict(description) == self.description and aggregation == self.aggregation
